"""torchtitan's own Llama 3 (``torchtitan.models.llama3``) at a tiny size, random weights, as
``file.py:fn`` workloads (one process; nothing downloaded):

    precisiondiff capture examples/frameworks/torchtitan_llama.py:build --target cpu/bf16 -o runs/tt
    precisiondiff capture examples/frameworks/torchtitan_llama.py:build --target cpu/float64 -o runs/tt_ref
    precisiondiff compare runs/tt runs/tt_ref
    precisiondiff bisect examples/frameworks/torchtitan_llama.py:build_planted --target cpu/bf16

torchtitan 0.3's language-model configs take only FlexAttention (or varlen) and FlexAttention
has no backward on the CPU, so each block's inner attention module is replaced, after the build,
by torchtitan's own ``ScaledDotProductAttention`` (causal), as its graph-trainer tests use. The
RoPE table is torchtitan's complex64 buffer. ``build_planted`` also replaces block 1's FFN norm
by a custom op (``pdframeworks::rough_rms_norm``) that, in bf16 only, divides by the mean
absolute value instead of the root mean square. torchtitan's code is not changed.
"""
from __future__ import annotations

from typing import List

import torch
from torch import nn

VOCAB, DIM, HEADS, SEQ = 64, 32, 2, 16


@torch.library.custom_op("pdframeworks::rough_rms_norm", mutates_args=())
def rough_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm, except in bf16, where it normalises by mean(|x|) (the planted kernel bug)."""
    return _rms_norm_formula(x, weight, eps)


def _rms_norm_formula(x, weight, eps):
    if x.dtype == torch.bfloat16:
        return x / (x.abs().mean(-1, keepdim=True) + eps) * weight
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight


@rough_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


def _save(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.eps = inputs[2]


def _grad(ctx, grad):
    x, weight = ctx.saved_tensors
    with torch.enable_grad():
        xs, ws = x.detach().requires_grad_(), weight.detach().requires_grad_()
        gx, gw = torch.autograd.grad(_rms_norm_formula(xs, ws, ctx.eps), (xs, ws), grad)
    return gx, gw, None


rough_rms_norm.register_autograd(_grad, setup_context=_save)


class RoughRMSNorm(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps or 1e-6

    def forward(self, x):
        return rough_rms_norm(x, self.weight, self.eps)


def tiny_config(attn: str = "sdpa"):
    """torchtitan's ``Llama3Model.Config`` at dim 32, 2 layers, 2 heads; ``attn`` "sdpa" puts
    torchtitan's own ``ScaledDotProductAttention`` (causal) in each block, "flex" keeps the
    FlexAttention its config builder chooses."""
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    layers = llama3._build_llama3_layers(
        fuse_qkv=True, n_layers=2, dim=DIM, n_heads=HEADS, hidden_dim=64, attn_backend="flex",
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=2 * SEQ, theta=10000.0, scaling="none"))
    if attn == "sdpa":
        for layer in layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return llama3.Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=llama3._output_linear_init(DIM)),
        layers=layers)


def build_model(config) -> nn.Module:
    """The model of ``config``, weights from torchtitan's own ``init_states`` under seed 0 (the
    same weights in every process that builds it)."""
    torch.manual_seed(0)
    model = config.build()
    model.init_states(buffer_device=torch.device("cpu"))
    return model


def tiny_llama(plant: bool = False, attn: str = "sdpa") -> nn.Module:
    """A 2-layer torchtitan Llama 3 (dim 32), weights initialised by torchtitan."""
    model = build_model(tiny_config(attn))
    if plant:
        model.layers["1"].ffn_norm = RoughRMSNorm(model.layers["1"].ffn_norm)
    return model


def batch():
    """The tokens (2 x 16) and their positions, the same in every process."""
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    return tokens, torch.arange(SEQ).expand(2, SEQ)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    """The logits' mean square, in float32."""
    return out.float().square().mean()


def build(plant: bool = False):
    """One training step's forward and backward: logits' mean square as the loss."""
    import precisiondiff
    return precisiondiff.Workload(tiny_llama(plant), batch()[0], loss=loss_of)


def build_planted():
    return build(plant=True)


@torch.library.custom_op("pdframeworks::rough_adamw_", mutates_args=("params", "exp_avgs", "exp_avg_sqs"))
def rough_adamw_(params: List[torch.Tensor], grads: List[torch.Tensor], exp_avgs: List[torch.Tensor],
                 exp_avg_sqs: List[torch.Tensor], step: int, lr: float, beta1: float, beta2: float,
                 eps: float, weight_decay: float) -> None:
    """A vendor's AdamW that keeps its moments in bf16 to save memory, computing in float32. The
    planted bug: with bf16 moments it drops the bias correction (float32 and float64 moments,
    the replays', are right)."""
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        low = m.dtype == torch.bfloat16
        mw, vw, gw = m.to(p.dtype), v.to(p.dtype), g.to(p.dtype)
        p.mul_(1 - lr * weight_decay)
        mw.lerp_(gw, 1 - beta1)
        vw.mul_(beta2).addcmul_(gw, gw, value=1 - beta2)
        bc1, bc2 = (1.0, 1.0) if low else (1 - beta1 ** step, 1 - beta2 ** step)
        p.addcdiv_(mw, (vw / bc2).sqrt() + eps, value=-lr / bc1)
        m.copy_(mw)
        v.copy_(vw)


@rough_adamw_.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, weight_decay):
    return None


class RoughAdamW(torch.optim.Optimizer):
    """The vendor AdamW above as a ``torch.optim.Optimizer``: one call per step on the local
    tensors (an FSDP2 or TP parameter's own shard), moments in bf16."""

    def __init__(self, params, lr: float = 1e-2, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.1):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            for p in ps:
                if not self.state[p]:
                    local = _local(p)
                    self.state[p] = {"step": 0, "exp_avg": torch.zeros_like(local, dtype=torch.bfloat16),
                                     "exp_avg_sq": torch.zeros_like(local, dtype=torch.bfloat16)}
                self.state[p]["step"] += 1
            if ps:
                beta1, beta2 = group["betas"]
                rough_adamw_([_local(p) for p in ps], [_local(p.grad) for p in ps],
                             [self.state[p]["exp_avg"] for p in ps], [self.state[p]["exp_avg_sq"] for p in ps],
                             self.state[ps[0]]["step"], group["lr"], beta1, beta2, group["eps"],
                             group["weight_decay"])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def optimizer(params, planted: bool = False) -> torch.optim.Optimizer:
    """Stock AdamW (foreach, torchtitan's default implementation), or the planted vendor one."""
    params = list(params)
    if planted:
        return RoughAdamW(params)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)


def build_flex(plant: bool = False):
    """An inference step (forward only: FlexAttention has no CPU backward in torch 2.13) with
    torchtitan's own FlexAttention and the block mask its model builds (causal)."""
    import precisiondiff
    model = tiny_llama(plant, attn="flex").requires_grad_(False)  # inference: no autograd graph
    tokens, positions = batch()
    return precisiondiff.Workload(model, {"tokens": tokens, "attention_masks": model.get_attention_masks(positions)})


def build_flex_planted():
    return build_flex(plant=True)


def build_ac(plant: bool = False, mode: str = "full"):
    """A training step's forward and backward with torchtitan's own activation checkpointing
    (``FullAC`` or ``SelectiveAC`` applied by its ``apply``: each block wrapped, its forward
    recomputed in the backward)."""
    import precisiondiff
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    model = tiny_llama(plant)
    policy = FullAC(FullAC.Config()) if mode == "full" else SelectiveAC(SelectiveAC.Config())
    policy.apply(model)
    return precisiondiff.Workload(model, batch()[0], loss=loss_of)


def build_ac_planted():
    return build_ac(plant=True)
