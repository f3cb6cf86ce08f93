"""A tiny random GPT-2 trained by a Hugging Face ``Trainer`` under DDP on the CPU (gloo), one process
per rank, started by ``torchrun --nproc-per-node 2``: the Trainer takes its ranks from torchrun's
environment. Options: ``--capture DIR`` (``--mode``, ``--level``) / ``--watch DIR`` add precisiondiff's
callbacks; ``--plant`` replaces block 1's activation by a planted op; ``--bf16`` casts the model to
bf16; ``--save FILE`` writes rank 0's trained weights (safetensors)."""
from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import transformers  # noqa: E402


@torch.library.custom_op("pdtrainerddp::rough_gelu", mutates_args=())
def rough_gelu(x: torch.Tensor) -> torch.Tensor:
    """The planted kernel: GELU as x * sigmoid(x) in bf16 (a crude approximation), exact otherwise."""
    return x * torch.sigmoid(x) if x.dtype == torch.bfloat16 else torch.nn.functional.gelu(x)


@rough_gelu.register_fake
def _(x):
    return torch.empty_like(x)


def _gelu_grad(x, grad):
    cdf = 0.5 * (1 + torch.erf(x / 2 ** 0.5))
    return grad * (cdf + x * torch.exp(-0.5 * x * x) / (2 * torch.pi) ** 0.5)


rough_gelu.register_autograd(lambda ctx, grad: _gelu_grad(ctx.saved_tensors[0], grad),
                             setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))


class RoughGelu(torch.nn.Module):
    def forward(self, x):
        return rough_gelu(x)


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(3, 64, (16, 12), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    from precisiondiff.runtime.gloo_exit import guard_exit
    guard_exit()  # a plain gloo run has no precisiondiff session to guard its exit (docs/watch.md, "A gloo job's exit")
    parser = argparse.ArgumentParser()
    parser.add_argument("--capture", default=None)
    parser.add_argument("--mode", default="stats")
    parser.add_argument("--level", default="all")
    parser.add_argument("--watch", default=None)
    parser.add_argument("--plant", action="store_true")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--save", default=None)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default="trainer-out")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    callbacks = []
    if args.capture:
        from precisiondiff.capture.hf_trainer import CaptureCallback
        callbacks.append(CaptureCallback(args.capture, level=args.level, mode=args.mode))
    if args.watch:
        from precisiondiff.watch.hf import watch_callback
        callbacks.append(watch_callback(args.watch))
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                     bos_token_id=1, eos_token_id=2)
    model = transformers.GPT2LMHeadModel(config)
    if args.plant:
        model.transformer.h[1].mlp.act = RoughGelu()
    if args.bf16:
        model.to(torch.bfloat16)
    targs = transformers.TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=2,
                                           learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no",
                                           logging_strategy="no", disable_tqdm=True, seed=0,
                                           dataloader_num_workers=0, ddp_backend="gloo")
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=Tokens(), callbacks=callbacks)
    trainer.train()
    if args.save and trainer.args.process_index == 0:
        from safetensors.torch import save_file
        save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()
                   if k != "lm_head.weight"}, args.save)  # lm_head.weight is tied to wte
    for cb in callbacks:
        if getattr(cb, "error", None):
            print(f"callback error: {cb.error}", file=sys.stderr)
            sys.exit(3)


if __name__ == "__main__":
    main()
