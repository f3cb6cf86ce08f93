"""A DeepSpeed training job on a tiny random GPT-2, as a user would run it (nothing downloaded).

Run it plain, under capture or under bisect, unmodified (DS_ACCELERATOR=cpu on a CPU machine;
on a GPU or MLU machine leave DS_ACCELERATOR unset):

    DS_ACCELERATOR=cpu python examples/frameworks/deepspeed_gpt2.py --zero 2
    DS_ACCELERATOR=cpu precisiondiff capture --script examples/frameworks/deepspeed_gpt2.py -o runs/ds -- --zero 2
    DS_ACCELERATOR=cpu precisiondiff bisect --script examples/frameworks/deepspeed_gpt2.py -- --zero 1 --plant
    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 -m precisiondiff.cli capture --script \
        examples/frameworks/deepspeed_gpt2.py -o runs/ds2 -- --zero 2
    DS_ACCELERATOR=cpu precisiondiff watch --script examples/frameworks/deepspeed_gpt2.py -o runs/w -- --zero 3

``--zero N`` ZeRO stage (1, 2 or 3), ``--fp32`` turns bf16 off, ``--steps`` optimizer steps,
``--plant`` replaces block 1's MLP activation with a custom op (``pdframeworks::rough_gelu``)
that is wrong in bf16 only (the framework's code is not changed: one submodule's forward is);
``--plant-rank R`` does it on rank R only, under torchrun; ``--plant-optimizer`` trains with
``RoughAdamW``, a ``torch.optim`` optimizer whose update is a vendor op (``pdframeworks::rough_adamw_``)
that stores its first moment through bf16, passed to ``deepspeed.initialize`` for ZeRO to wrap.

``--capture DIR`` records the steps with the Python API instead (after ``deepspeed.initialize``),
for ``precisiondiff bisect DIR --workload examples/frameworks/deepspeed_gpt2.py:build_planted``
(the workload file registers the planted op for the replay; the bare model's paths are resolved
under the engine's ``module.`` prefix).

``build`` is the same model as a plain ``file.py:fn`` workload (no engine): the float64
reference a DeepSpeed dump is compared with (``precisiondiff capture
examples/frameworks/deepspeed_gpt2.py:build --target cpu/float64 -o runs/ref``).
"""
from __future__ import annotations

import argparse
import contextlib
import os

import torch
from torch import nn

VOCAB, SEQ, BATCH = 64, 16, 2


@torch.library.custom_op("pdframeworks::rough_gelu", mutates_args=())
def rough_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU, except in bf16, where it is x * sigmoid(x) (the planted kernel bug)."""
    if x.dtype == torch.bfloat16:
        return x * torch.sigmoid(x)
    return torch.nn.functional.gelu(x, approximate="tanh")


@rough_gelu.register_fake
def _(x):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad):
    """The derivative of whichever function the forward computed (the bug is in the forward)."""
    (x,) = ctx.saved_tensors
    with torch.enable_grad():
        leaf = x.detach().requires_grad_()
        y = leaf * torch.sigmoid(leaf) if x.dtype == torch.bfloat16 else \
            torch.nn.functional.gelu(leaf, approximate="tanh")
        return torch.autograd.grad(y, leaf, grad)[0]


rough_gelu.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("pdframeworks::rough_adamw_", mutates_args=("param", "exp_avg", "exp_avg_sq"))
def rough_adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 step: float, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW update of a parameter, in place: a "vendor" kernel that stores its first moment
    rounded through bf16 (the planted optimizer bug; the state is float32 under ZeRO)."""
    _adamw(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, rough=True)


@rough_adamw_.register_fake
def _(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    return None


def _adamw(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, rough=False):
    """AdamW (decoupled weight decay, bias-corrected), in place; ``rough``: the planted bug."""
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    if rough:
        exp_avg.copy_(exp_avg.to(torch.bfloat16))
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq / (1 - beta2 ** step)).sqrt_().add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** step))


class RoughAdamW(torch.optim.Optimizer):
    """A ``torch.optim`` AdamW whose update is the ``rough_adamw_`` op: the client optimizer that
    DeepSpeed's ZeRO wraps (its parameters become ZeRO's flat fp32 partitions)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                beta1, beta2 = group["betas"]
                torch.ops.pdframeworks.rough_adamw_(p, p.grad.to(p.dtype), state["exp_avg"], state["exp_avg_sq"],
                                                    float(state["step"]), group["lr"], beta1, beta2, group["eps"],
                                                    group["weight_decay"])
        return None


def _register_adamw_reference() -> None:
    """The correct update as bisect's reference of the vendor op (golden and float32 peer alike):
    without it the peer would be the vendor op itself run in float32, which has the same bug."""
    try:
        import precisiondiff
    except ImportError:  # the example runs without precisiondiff too
        return
    precisiondiff.register_reference("pdframeworks::rough_adamw_", _adamw)


_register_adamw_reference()


class RoughGelu(nn.Module):
    def forward(self, x):
        return rough_gelu(x)


def tiny_gpt2(plant: bool = False) -> nn.Module:
    """A 2-layer GPT-2 of transformers' own code, random weights (seeded by the caller)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                        attn_implementation="eager")
    model = GPT2LMHeadModel(config)
    if plant:
        model.transformer.h[1].mlp.act = RoughGelu()
    return model


def batch(step: int = 0) -> torch.Tensor:
    """The token ids of a step, the same on every rank."""
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def build(plant: bool = False):
    """The workload of one step without DeepSpeed: the reference side of a compare."""
    import precisiondiff
    ids = batch(0)
    return precisiondiff.Workload(tiny_gpt2(plant), {"input_ids": ids, "labels": ids},
                                  loss=lambda out: out.loss)


def build_planted():
    return build(plant=True)


def _ds_config(zero: int, bf16: bool, client_optimizer: bool = False) -> dict:
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": zero}, "bf16": {"enabled": bf16},
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if client_optimizer:  # the optimizer passed to deepspeed.initialize, not DeepSpeed's own
        del config["optimizer"]
        config["zero_allow_untested_optimizer"] = True
    return config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3])
    parser.add_argument("--fp32", action="store_true")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--plant", action="store_true")
    parser.add_argument("--plant-rank", type=int, default=None, metavar="R",
                        help="plant on rank R only (the other ranks run the stock GELU)")
    parser.add_argument("--plant-optimizer", action="store_true",
                        help="train with RoughAdamW (a vendor AdamW op storing its first moment through bf16), "
                             "passed to deepspeed.initialize for ZeRO to wrap")
    parser.add_argument("--capture", metavar="DIR", default=None,
                        help="capture the steps with the Python API (replay mode) into DIR")
    args = parser.parse_args()
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29511"}.items():
        os.environ.setdefault(key, value)  # one process without torchrun
    torch.set_num_threads(1)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    planted = args.plant if args.plant_rank is None else int(os.environ["RANK"]) == args.plant_rank
    model = tiny_gpt2(planted)
    client = RoughAdamW(model.parameters()) if args.plant_optimizer else None
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=client,
                                           config=_ds_config(args.zero, not args.fp32, client is not None))
    with contextlib.ExitStack() as stack:
        cap = None
        if args.capture:  # after deepspeed.initialize: the engine's own setup is not recorded
            import precisiondiff
            cap = stack.enter_context(precisiondiff.capture(args.capture, model=engine, mode="replay"))
        for step in range(args.steps):
            ids = batch(step).to(engine.device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            if cap is not None:
                cap.step()
            if int(os.environ["RANK"]) == 0:
                print(f"step {step} loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
