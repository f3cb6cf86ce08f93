"""megatron-core's own ``GPTModel`` (tiny, random weights, its tensor-parallel layers), trained as a
user would, or built as a ``file.py:fn`` workload (nothing downloaded):

    python examples/frameworks/megatron_gpt.py --bf16                      # plain: 2 steps, TP=1
    torchrun --nproc-per-node 2 examples/frameworks/megatron_gpt.py --bf16  # TP=2
    precisiondiff capture --script examples/frameworks/megatron_gpt.py -o runs/mg --level all \\
        --mode replay --steps 0 -- --bf16
    precisiondiff capture examples/frameworks/megatron_gpt.py:build --target cpu/float64 -o runs/mg_ref
    precisiondiff compare runs/mg runs/mg_ref --kind module
    precisiondiff bisect examples/frameworks/megatron_gpt.py:build_planted --target cpu/bf16
    torchrun --nproc-per-node 2 -m precisiondiff bisect --script examples/frameworks/megatron_gpt.py \\
        --keep runs/tp2 -- --bf16 --plant
    precisiondiff ranks runs/tp2

The script: ``parallel_state.initialize_model_parallel(TP)`` (TP = the world size: 1 alone, 2
under ``torchrun --nproc-per-node 2``; gloo on the CPU, NCCL on CUDA), ``GPTModel`` (2 layers,
hidden 32, 2 heads, RoPE, megatron's local layer spec: its ``ColumnParallelLinear`` /
``RowParallelLinear``), ``--bf16`` wraps it in Megatron's ``Float16Module``, the loss is Megatron's
own vocab-parallel cross entropy (``labels=``), AdamW, ``--steps`` steps. ``--plant`` replaces
block 1's MLP activation (``mlp.activation_func``, inside the tensor-parallel region: each rank
applies it to its shard) by a custom op ``pdframeworks::rough_gelu_mg`` that is wrong in bf16
only; megatron's code is not changed. ``--capture DIR`` records the steps with the Python API
(every level, replay mode) after the model is built.

``build`` / ``build_planted`` are the same model, first batch and loss as a workload, TP=1 (a
1-process gloo group is created if none exists), for the single-process float64 reference and
for bisect; ``build_planted_wrapped`` is the planted one inside ``Float16Module``, the
``--workload`` of an API capture of ``--bf16 --plant``:

    python examples/frameworks/megatron_gpt.py --bf16 --plant --steps 1 --capture runs/mg_api
    precisiondiff bisect runs/mg_api --workload examples/frameworks/megatron_gpt.py:build_planted_wrapped

megatron-core 0.16 calls CUDA unconditionally in four places (its RNG tracker, the rotary
embedding, a memory-buffer utility and the default causal mask). On a machine without CUDA this
file installs the test suite's CPU shim (``tests/frameworks/megatron_shim.py``: monkeypatches,
nothing of megatron's files changed); on a GPU the model is built on CUDA and no shim is loaded.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

VOCAB, SEQ, BATCH, HIDDEN, HEADS, LAYERS = 64, 16, 2, 32, 2, 2


@torch.library.custom_op("pdframeworks::rough_gelu_mg", mutates_args=())
def rough_gelu_mg(x: torch.Tensor) -> torch.Tensor:
    """GELU, except in bf16, where it is x * sigmoid(1.5 x) (the planted kernel bug)."""
    return _gelu_formula(x)


def _gelu_formula(x):
    if x.dtype == torch.bfloat16:
        return x * torch.sigmoid(1.5 * x)
    return torch.nn.functional.gelu(x)


@rough_gelu_mg.register_fake
def _(x):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    with torch.enable_grad():
        leaf = x.detach().requires_grad_()
        return torch.autograd.grad(_gelu_formula(leaf), leaf, grad)[0]


rough_gelu_mg.register_autograd(_backward, setup_context=_setup)


def _cpu_shim() -> None:
    if torch.cuda.is_available():
        return
    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:
        sys.path.insert(0, root)
    from tests.frameworks import megatron_shim
    megatron_shim.install()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(seed: int = 0) -> int:
    """The process group (torchrun's, or a 1-process gloo group) and Megatron's model-parallel
    state, TP = the world size; Megatron's RNG tracker seeded. Returns the TP size."""
    _cpu_shim()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" in os.environ:
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5))
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    tp = dist.get_world_size()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(seed)
    return tp


def gpt(tp: int, *, plant: bool = False, bf16: bool = False):
    """A 2-layer ``GPTModel`` with megatron's local layer spec; its config."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               tensor_model_parallel_size=tp, hidden_dropout=0.0, attention_dropout=0.0,
                               use_cpu_initialization=True, params_dtype=torch.float32, bf16=bf16)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope")
    if plant:
        model.decoder.layers[1].mlp.activation_func = rough_gelu_mg
    return model, config


def batch(device: "str | torch.device" = "cpu") -> dict:
    """GPTModel's keyword arguments for one batch: tokens, positions, no mask (causal), labels."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return {"input_ids": tokens[:, :-1].to(device), "labels": tokens[:, 1:].to(device),
            "position_ids": torch.arange(SEQ).expand(BATCH, SEQ).to(device), "attention_mask": None}


def build(plant: bool = False, wrapped: bool = False):
    """The first step's forward and backward as a workload, TP=1: the mean token loss.
    ``wrapped``: the model inside Megatron's ``Float16Module`` (bf16), as ``--bf16`` runs it."""
    import precisiondiff
    tp = init_parallel()
    if tp != 1:
        raise RuntimeError(f"build() is the single-process model (TP=1); this process group has {tp} ranks")
    model, config = gpt(1, plant=plant, bf16=wrapped)
    if wrapped:
        from megatron.core.transformer.module import Float16Module
        model = Float16Module(config, model)
    return precisiondiff.Workload(model, batch(), loss=lambda out: out.float().mean())


def build_planted():
    return build(plant=True)


def build_planted_wrapped():
    """The planted model inside ``Float16Module``: the ``--workload`` for bisecting an API
    capture of ``--bf16 --plant`` (its module paths are under the wrapper's ``module.``)."""
    return build(plant=True, wrapped=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--bf16", action="store_true", help="wrap the model in Megatron's Float16Module")
    parser.add_argument("--plant", action="store_true")
    parser.add_argument("--capture", metavar="DIR", help="capture with the Python API (every level, replay)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    tp = init_parallel()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model, config = gpt(tp, plant=args.plant, bf16=args.bf16)
    model = model.to(device)
    if args.bf16:
        from megatron.core.transformer.module import Float16Module
        model = Float16Module(config, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = batch(device)
    capture = contextlib.nullcontext()
    if args.capture:
        import precisiondiff
        capture = precisiondiff.capture(args.capture, model=model, level="all", mode="replay")
    with capture as cap:
        for step in range(args.steps):
            loss = model(**inputs).float().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if cap is not None:
                cap.step()
            if dist.get_rank() == 0:
                print(f"step {step} loss {loss.item():.9g}", flush=True)
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
