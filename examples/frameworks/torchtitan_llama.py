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


def tiny_llama(plant: bool = False) -> nn.Module:
    """A 2-layer torchtitan Llama 3 (dim 32), SDPA attention, weights initialised by torchtitan."""
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    config = llama3.Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=llama3._output_linear_init(DIM)),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True, n_layers=2, dim=DIM, n_heads=HEADS, hidden_dim=64, attn_backend="flex",
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=2 * SEQ, theta=10000.0, scaling="none")))
    model = config.build()
    model.init_states(buffer_device=torch.device("cpu"))
    for layer in model.layers.values():
        layer.attention.inner_attention = ScaledDotProductAttention(ScaledDotProductAttention.Config())
    if plant:
        model.layers["1"].ffn_norm = RoughRMSNorm(model.layers["1"].ffn_norm)
    return model


def build(plant: bool = False):
    """One training step's forward and backward: logits' mean square as the loss."""
    import precisiondiff
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    return precisiondiff.Workload(tiny_llama(plant), tokens, loss=lambda out: out.float().square().mean())


def build_planted():
    return build(plant=True)
