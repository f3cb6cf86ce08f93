"""A small decoder trained for a few AdamW steps, with an optional planted divergence: from step
``planted_step`` on, the MLP of block ``planted_layer`` returns its output scaled by
(1 + ``planted_scale``), 2**-9 by default (a kernel that goes wrong mid-run). Importable by the tests and runnable as a script for
``precisiondiff watch --script``::

    python tests/watch/train.py --steps 6 --dtype float32 [--planted-step 3 --planted-layer 1]
        [--kill-after 3] [--perturb] [--broken-from 4]

``--broken-from K`` (``gelu_op=True``): block ``planted_layer``'s MLP activation is a custom op,
``pdwatch::fused_gelu`` (a vendor's fused kernel), whose low-precision path scales its output by
``BROKEN["scale"]`` (1.125) while :data:`BROKEN` is on; the script turns it on from step K (the tests flip it
themselves). Bisect replays the op from a dump and names it.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from tiny_transformer import TinyTransformer  # noqa: E402

VOCAB = 128
BROKEN = {"on": False, "scale": 1.125}


@torch.library.custom_op("pdwatch::fused_gelu", mutates_args=())
def fused_gelu(x: torch.Tensor) -> torch.Tensor:
    y = F.gelu(x)
    if BROKEN["on"] and x.dtype != torch.float64:
        return y * BROKEN["scale"]  # the planted bug: a stale scale on the low-precision path
    return y


@fused_gelu.register_fake
def _(x):
    return torch.empty_like(x)


def _gelu_backward(ctx, grad):
    return torch.ops.aten.gelu_backward(grad, ctx.saved_tensors[0])


fused_gelu.register_autograd(_gelu_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))


def _fused_mlp_forward(mlp, x):
    return mlp.fc2(fused_gelu(mlp.fc1(x)))


class Planted:
    """A forward hook on one MLP that scales its output from a given call on."""

    def __init__(self, start: int, scale: float) -> None:
        self.start, self.scale, self.calls = start, scale, 0

    def __call__(self, module, args, output):
        self.calls += 1
        if self.calls > self.start:
            return output * (1 + self.scale)
        return None


def build(*, dtype: torch.dtype = torch.float32, seed: int = 0, layers: int = 3,
          planted_step: Optional[int] = None, planted_layer: int = 1, planted_scale: float = 2.0 ** -9,
          perturb: bool = False, fused_norm: bool = False, gelu_op: bool = False):
    """(model, optimizer, tokens): the same weights and data for every dtype (built in float32).
    ``fused_norm``: the example's RMSNorm kernel whose bf16 path accumulates in bf16 (a custom op)."""
    torch.manual_seed(seed)
    model = TinyTransformer(vocab=VOCAB, dim=32, heads=4, layers=layers, fused_norm=fused_norm)
    tokens = torch.randint(0, VOCAB, (2, 12))
    model = model.to(dtype).train()
    if perturb:  # a run that differs by rounding only: every weight moved by about one ulp
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed + 1)
            for p in model.parameters():
                p.mul_(1 + torch.finfo(dtype).eps * (torch.rand(p.shape, generator=g) - 0.5).to(dtype))
    if planted_step is not None:
        model.blocks[planted_layer].mlp.register_forward_hook(Planted(planted_step, planted_scale))
    if gelu_op:
        mlp = model.blocks[planted_layer].mlp
        mlp.forward = _fused_mlp_forward.__get__(mlp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return model, opt, tokens


def train_step(model, opt, tokens) -> torch.Tensor:
    logits = model(tokens).float()
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def train(steps: int, *, watch_dir: Optional[str] = None, watch_options: Optional[dict] = None,
          broken_from: Optional[int] = None, **build_options) -> Dict[str, torch.Tensor]:
    """Train ``steps`` steps (under ``precisiondiff.watch`` when ``watch_dir`` is given); the final
    parameters. ``broken_from``: the planted ``pdwatch::fused_gelu`` goes wrong from that step."""
    if broken_from is not None:
        build_options["gelu_op"] = True
    model, opt, tokens = build(**build_options)
    try:
        if watch_dir is None:
            for step in range(steps):
                BROKEN["on"] = broken_from is not None and step >= broken_from
                train_step(model, opt, tokens)
        else:
            import precisiondiff
            with precisiondiff.watch(watch_dir, model=model, optimizer=opt, **(watch_options or {})) as w:
                for step in range(steps):
                    BROKEN["on"] = broken_from is not None and step >= broken_from
                    w.step(loss=train_step(model, opt, tokens))
    finally:
        BROKEN["on"] = False
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--planted-step", type=int, default=None)
    parser.add_argument("--planted-layer", type=int, default=1)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--kill-after", type=int, default=None, help="SIGKILL itself after this many steps")
    parser.add_argument("--perturb", action="store_true")
    parser.add_argument("--fused-norm", action="store_true")
    parser.add_argument("--broken-from", type=int, default=None, help="pdwatch::fused_gelu goes wrong from this step")
    parser.add_argument("--broken-scale", type=float, default=1.125, help="what it then scales its output by")
    args = parser.parse_args(argv)
    model, opt, tokens = build(dtype=getattr(torch, args.dtype), planted_step=args.planted_step,
                               planted_layer=args.planted_layer, layers=args.layers, perturb=args.perturb,
                               fused_norm=args.fused_norm, gelu_op=args.broken_from is not None)
    BROKEN["scale"] = args.broken_scale
    for step in range(args.steps):
        BROKEN["on"] = args.broken_from is not None and step >= args.broken_from
        if args.kill_after is not None and step == args.kill_after:
            import signal
            os.kill(os.getpid(), signal.SIGKILL)
        train_step(model, opt, tokens)


def workload():
    """The model as a ``precisiondiff.Workload`` (``bisect DUMP --workload tests.watch.train:workload``
    imports this module, which registers ``pdwatch::fused_gelu``, and rebuilds the modules)."""
    import precisiondiff
    model, _, tokens = build(gelu_op=True)
    return precisiondiff.Workload(model, tokens)


if __name__ == "__main__":
    main()
