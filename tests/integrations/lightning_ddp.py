"""A tiny LightningModule trained under DDP on the CPU (gloo), one process per rank, started by
``torchrun --nproc-per-node 2``: Lightning takes its ranks from torchrun's environment. Options:
``--capture DIR`` / ``--watch DIR`` add precisiondiff's callbacks; ``--plant`` replaces the
activation by a planted op; ``--save FILE`` writes rank 0's trained weights (safetensors)."""
from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning.pytorch as L  # noqa: E402


@torch.library.custom_op("pdlightning::rough_tanh", mutates_args=())
def rough_tanh(x: torch.Tensor) -> torch.Tensor:
    """The planted kernel: tanh off by 2 % on every element in bf16 (a vendor's low-precision path),
    exact in float32 and float64 (the emulated peer's and the reference's)."""
    return torch.tanh(x) * 1.02 if x.dtype == torch.bfloat16 else torch.tanh(x)


@rough_tanh.register_fake
def _(x):
    return torch.empty_like(x)


rough_tanh.register_autograd(lambda ctx, grad: grad * (1 - torch.tanh(ctx.saved_tensors[0]) ** 2),
                             setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))


class RoughTanh(nn.Module):
    def forward(self, x):
        return rough_tanh(x)


class Tiny(L.LightningModule):
    def __init__(self, plant: bool = False):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), RoughTanh() if plant else nn.Tanh(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    from precisiondiff.runtime.gloo_exit import guard_exit
    guard_exit()  # a plain gloo run has no precisiondiff session to guard its exit (docs/watch.md, "A gloo job's exit")
    parser = argparse.ArgumentParser()
    parser.add_argument("--capture", default=None)
    parser.add_argument("--mode", default="stats")
    parser.add_argument("--watch", default=None)
    parser.add_argument("--plant", action="store_true")
    parser.add_argument("--save", default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--precision", default="32-true", help="Lightning's precision, e.g. bf16-true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    callbacks = []
    if args.capture:
        from precisiondiff.capture.lightning import CaptureCallback
        callbacks.append(CaptureCallback(args.capture, level="all", mode=args.mode))
    if args.watch:
        from precisiondiff.watch.lightning import watch_callback
        callbacks.append(watch_callback(args.watch))
    torch.manual_seed(0)
    module = Tiny(args.plant)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(48, 6, generator=g), torch.randn(48, 3, generator=g))
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", "1")),
                        strategy="ddp", precision=args.precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    if args.save and trainer.global_rank == 0:
        from safetensors.torch import save_file
        save_file({k: v.detach().contiguous() for k, v in module.state_dict().items()}, args.save)
    for cb in callbacks:
        if getattr(cb, "error", None):
            print(f"callback error: {cb.error}", file=sys.stderr)
            sys.exit(3)


if __name__ == "__main__":
    main()
