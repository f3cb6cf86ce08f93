"""torchtitan's own Llama 3 (tiny, random weights) trained on 2 ranks through torchtitan's own
``parallelize_llama``: FSDP2 (``--fsdp 2``) or tensor parallel (``--tp 2``, sequence parallel as
torchtitan's default config has it), optionally with its activation checkpointing (``--ac full``
or ``selective``); gloo on the CPU, every rank fed the same batch, torchtitan's code unchanged:

    torchrun --nproc-per-node 2 examples/frameworks/torchtitan_parallel.py --fsdp 2
    torchrun --nproc-per-node 2 -m precisiondiff capture --script examples/frameworks/torchtitan_parallel.py \\
        -o runs/fsdp --mode replay -- --fsdp 2 --steps 1
    torchrun --nproc-per-node 2 -m precisiondiff bisect --script examples/frameworks/torchtitan_parallel.py \\
        -- --tp 2 --plant 1

The model and first batch are those of ``torchtitan_llama.py:build`` (the same seed), so a
single-process float64 capture of that workload is the reference of every rank.

Glue, and why (none of it changes torchtitan's code): torchtitan picks its mesh's device type at
import (``torchtitan.tools.utils.device_type``: "cuda" when no accelerator is found), so on a
CPU-only machine ``parallel_dims.device_type`` is set to "cpu" before the mesh is built; on a GPU
or MLU machine leave it alone. ``--plant RANK`` replaces, on that rank only, the forward of block
1's FFN norm by the custom op ``pdframeworks::rough_rms_norm`` (wrong in bf16 only), keeping the
torchtitan module and its sharding config. ``--attn flex`` keeps torchtitan's FlexAttention (its
config's default; forward only on the CPU: ``--forward-only``).
"""
from __future__ import annotations

import argparse
import os
import sys
import types

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchtitan_llama as tt  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fsdp", type=int, default=1, help="FSDP2 shard degree (data_parallel_shard_degree)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel degree")
    p.add_argument("--no-sp", action="store_true", help="tensor parallel without sequence parallel")
    p.add_argument("--ac", choices=["none", "full", "selective"], default="none")
    p.add_argument("--attn", choices=["sdpa", "flex"], default="sdpa")
    p.add_argument("--forward-only", action="store_true", help="one forward under no_grad (an inference step)")
    p.add_argument("--plant", type=int, default=None, metavar="RANK", help="plant the rough RMSNorm on this rank")
    p.add_argument("--plant-optimizer", type=int, default=None, metavar="RANK",
                   help="on this rank, the AdamW update is the planted pdframeworks::rough_adamw")
    p.add_argument("--spmd-backend", choices=["partial_dtensor", "full_dtensor", "spmd_types"],
                   default="partial_dtensor", help="torchtitan's parallelism.spmd_backend (its default, "
                   "spmd_types, fails in torch 2.13's fully_shard: see docs/frameworks.md)")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--param-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="FSDP2's mixed_precision_param (torchtitan's default: bfloat16)")
    return p.parse_args(argv)


def plant_rough_norm(norm: torch.nn.Module) -> None:
    """Make ``norm`` (a torchtitan RMSNorm) compute through the planted custom op, in place."""
    def forward(self, x):
        from torch.distributed.tensor import DTensor, Partial, Replicate
        if not isinstance(x, DTensor):
            return tt.rough_rms_norm(x, self.weight, self.eps or 1e-6)
        # under sequence parallel the norm runs on sequence shards: the kernel on the local
        # tensors (a custom op has no DTensor sharding rule), as a vendor kernel's wrapper does
        w = self.weight
        if isinstance(w, DTensor):  # the weight's gradient from a sequence shard is a partial sum
            w = w.to_local(grad_placements=[Partial() if p.is_shard() else Replicate() for p in x.placements])
        out = tt.rough_rms_norm(x.to_local(), w, self.eps or 1e-6)
        return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)
    norm.forward = types.MethodType(forward, norm)


def parallel_model(args, rank: int):
    """The tiny Llama, planted on ``--plant``'s rank, parallelized by torchtitan's own code."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import parallel_dims as pd_module
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.llama3.parallelize import parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    parallelism = ParallelismConfig(data_parallel_shard_degree=args.fsdp, tensor_parallel_degree=args.tp,
                                    enable_sequence_parallel=not args.no_sp, spmd_backend=args.spmd_backend)
    training = TrainingConfig(local_batch_size=2, seq_len=tt.SEQ, mixed_precision_param=args.param_dtype)
    config = tt.tiny_config(args.attn)
    set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)  # what the trainer does
    model = tt.build_model(config)
    if args.plant == rank:
        plant_rough_norm(model.layers["1"].ffn_norm)
    if not torch.accelerator.is_available():
        pd_module.device_type = "cpu"  # torchtitan defaults to "cuda" without an accelerator
    dims = pd_module.ParallelDims.from_config(parallelism, dist.get_world_size())
    dims.build_mesh()
    ac = {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[args.ac]
    model = parallelize_llama(model, parallel_dims=dims, training=training, parallelism=parallelism,
                              compile_config=CompileConfig(), ac_config=ac, dump_folder="")
    if dist.get_backend() == "gloo":  # gloo has no PREMUL_SUM/AVG: FSDP2 then scales around a SUM
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return model


def _value(loss: torch.Tensor) -> float:
    """The loss as a number (under TP it is a DTensor of partial sums over the vocabulary shards)."""
    return (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).item()


def main(argv=None) -> None:
    args = parse(argv)
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = parallel_model(args, rank)
    tokens, positions = tt.batch()
    kwargs = {"attention_masks": model.get_attention_masks(positions=positions)} if args.attn == "flex" else {}
    if args.forward_only:
        with torch.no_grad():
            out = model(tokens, **kwargs)
        print(f"rank {rank} forward {_value(tt.loss_of(out)):.9g}", flush=True)
    else:
        opt = tt.optimizer(model.parameters(), planted=args.plant_optimizer == rank)
        for step in range(args.steps):
            loss = tt.loss_of(model(tokens, **kwargs))
            loss.backward()
            opt.step()
            opt.zero_grad()
            print(f"rank {rank} step {step} loss {_value(loss):.9g}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
