"""A CPU shim for megatron-core (test-only, like the stand-in ``mlu`` device): :func:`install`.

megatron-core 0.16 runs its own model code and tensor-parallel layers on gloo, except for three
places where it calls CUDA unconditionally, even with ``use_cpu_initialization=True``:

* its RNG tracker (``tensor_parallel.random``: ``model_parallel_cuda_manual_seed`` and the
  tracker's ``add`` / ``fork`` read and set ``torch.cuda`` generator states);
* the rotary embedding (``RotaryEmbedding.get_emb`` moves ``inv_freq`` to
  ``torch.cuda.current_device()`` on its first call);
* a utility, ``GlobalMemoryBuffer.get_tensor`` (the attention's ``baddbmm`` input buffer is
  allocated on ``torch.cuda.current_device()``).

:func:`install` monkeypatches exactly these (no file of megatron is changed): the tracker keeps
CPU generator states, and the other two run with ``torch.cuda.current_device`` answering the CPU
for the length of the call. On a GPU or MLU machine nothing of this is needed (or installed):
``install`` does nothing when CUDA is available.
"""
from __future__ import annotations

import contextlib
import functools

import torch

__all__ = ["install"]

_INSTALLED = False


@contextlib.contextmanager
def _current_device_is_the_cpu():
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        torch.cuda.current_device = saved


def _on_the_cpu(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _current_device_is_the_cpu():
            return fn(*args, **kwargs)
    return wrapper


def _get_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _add(self, name, seed):
    """``CudaRNGStatesTracker.add`` with a CPU generator state (the same checks)."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    self.states_[name] = torch.Generator().manual_seed(seed).get_state()


def _causal_mask(sq: int) -> torch.Tensor:
    """``transformer.utils.get_default_causal_mask`` on the CPU (it names ``device="cuda"``)."""
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def install() -> bool:
    """Patch megatron-core's three CUDA-only places for the CPU (module docstring); idempotent.

    Returns:
        True when the shim is (now) installed, False on a machine with CUDA (nothing patched).
    """
    global _INSTALLED
    if torch.cuda.is_available():
        return False
    if _INSTALLED:
        return True
    from megatron.core import utils
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.tensor_parallel import random

    random._get_cuda_rng_state = _get_rng_state
    random._set_cuda_rng_state = _set_rng_state
    random.CudaRNGStatesTracker.add = _add
    rotary_pos_embedding.RotaryEmbedding.get_emb = _on_the_cpu(rotary_pos_embedding.RotaryEmbedding.get_emb)
    utils.GlobalMemoryBuffer.get_tensor = _on_the_cpu(utils.GlobalMemoryBuffer.get_tensor)
    transformer_utils.get_default_causal_mask = _causal_mask
    fused_softmax.get_default_causal_mask = _causal_mask  # imported there by name
    _INSTALLED = True
    return True
