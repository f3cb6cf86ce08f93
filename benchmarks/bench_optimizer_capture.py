"""What recording the optimizer's update adds to a captured training step.

    python benchmarks/bench_optimizer_capture.py [--layers 8] [--width 256] [--repeats 10]

An MLP of ``--layers`` Linear(width, width) trained with AdamW (foreach, fused and the
single-tensor loop), op-level statistics capture into memory, one intra-op thread. Each step is
timed with the update recorded (direction ``optimizer``: docs/capture.md, "Optimizers") and with
it paused as before (gradients taken, the update's ops not recorded), interleaved; the fastest
of ``--repeats`` steps after two warm-up steps. Prints both and their ratio, and the update
events per step.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import precisiondiff  # noqa: E402
from precisiondiff.capture import MemorySink  # noqa: E402
from precisiondiff.capture.hooks import ModuleHooks  # noqa: E402


def _paused_pre(self, optimizer, args, kwargs) -> None:
    self._emit_param_grads()
    self.paused = True


def _paused_post(self, optimizer, args, kwargs) -> None:
    self.paused = False


def step_time(kind: dict, record: bool, layers: int, width: int, repeats: int) -> "tuple[float, int]":
    """The fastest captured step (seconds) and the update events of one step."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **kind)
    x = torch.randn(64, width)
    saved = ModuleHooks._optimizer_pre, ModuleHooks._resume
    if not record:
        ModuleHooks._optimizer_pre, ModuleHooks._resume = _paused_pre, _paused_post
    sink = MemorySink()
    try:
        with precisiondiff.capture(model=model, mode="stats", sink=sink) as cap:
            times = []
            for _ in range(repeats + 2):
                start = time.perf_counter()
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                cap.step()
                times.append(time.perf_counter() - start)
    finally:
        ModuleHooks._optimizer_pre, ModuleHooks._resume = saved
    updates = sum(1 for e in sink.events if e["direction"] == "optimizer" and e["step"] == 1)
    return min(times[2:]), updates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for kind in ({"foreach": True}, {"fused": True}, {"foreach": False}):
        paused, _ = step_time(kind, False, args.layers, args.width, args.repeats)
        recorded, events = step_time(kind, True, args.layers, args.width, args.repeats)
        print(f"AdamW {kind}: captured step {paused * 1e3:.1f} ms with the update paused, {recorded * 1e3:.1f} ms "
              f"with it recorded ({events} update events): x{recorded / paused:.2f}")


if __name__ == "__main__":
    main()
