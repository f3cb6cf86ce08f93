"""Train the bundled tiny transformer for a few SGD steps in one dtype: a script to capture with
``--script``, so that a drift between a low-precision run and the float64 reference can be
watched step by step (``precisiondiff report DUT REF --tensorboard DIR``, docs/integrations.md)::

    precisiondiff capture --script examples/train_tiny.py -o runs/train-bf16 --level module \\
        --mode tensors -- --dtype bfloat16 --steps 40
    precisiondiff capture --script examples/train_tiny.py -o runs/train-fp64 --level module \\
        --mode tensors -- --dtype float64 --steps 40
    precisiondiff report runs/train-bf16 runs/train-fp64 --tensorboard runs/tb

The model, the data and the initial weights are the same for every dtype (seeded, built in
float32, then cast). Each ``optimizer.step()`` ends a captured step.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_transformer import build  # noqa: E402


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", help="float64, float32, bfloat16 or float16")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    w = build()
    model, tokens = w.model.to(dtype).train(), w.inputs
    targets = torch.roll(tokens, -1, dims=1)  # learn to predict the next token of a fixed batch
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        logits = model(tokens).float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.6f}")
    return loss.item()


if __name__ == "__main__":
    main()
