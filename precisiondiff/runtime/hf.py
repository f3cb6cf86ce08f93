"""Hugging Face workloads: ``hf:PATH`` builds a transformers model from local files only.

``PATH`` is one of

- a checkpoint directory (``config.json`` and weights, ``save_pretrained`` output): the
  weights are loaded;
- a directory holding only ``config.json``, or the path of a ``config.json`` (any file name
  ending in ``.json``): the model is built from the config with random weights (seeded by the
  workload loader, so every target gets the same weights).

Nothing is downloaded: ``HF_HUB_OFFLINE=1`` is set while transformers loads and every
``from_pretrained`` gets ``local_files_only=True``. Inputs are a batch of example sentences
tokenised by the checkpoint's own tokenizer when one is stored in the directory, else random
token ids in the vocabulary's range from a generator seeded with ``seed``. The loss is the
model's own: a causal-LM head gets ``labels = input_ids`` (the shifted next-token
cross-entropy), a sequence-classification head gets class-0 labels, a masked-LM head gets
``labels = input_ids``; a model without a head gets ``mean(last_hidden_state ** 2)`` so that the
backward pass is captured too.

Attention runs the ``eager`` implementation by default: each softmax and matmul is an op of
its own that capture and bisect can name (``sdpa`` is one fused kernel).

Example::

    precisiondiff capture hf:checkpoints/tiny-llama -o runs/dut
    precisiondiff bisect hf:configs/gpt2-tiny/config.json
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, NamedTuple, Optional

import torch

from ..errors import WorkloadError

__all__ = ["build_hf", "HFParts", "EXAMPLE_TEXT", "WEIGHT_FILES", "TOKENIZER_FILES"]

PREFIX = "hf:"

EXAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog, and the dog does not mind at all.",
    "Numerical accuracy on an accelerator is measured against a float64 reference.",
)

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError as err:
        raise WorkloadError("hf: workloads need transformers: pip install 'precisiondiff[hf]' "
                            "(or pip install transformers)") from err
    return transformers


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """HF_HUB_OFFLINE=1 (and TRANSFORMERS_OFFLINE=1), no progress bars; restored after."""
    from transformers.utils import logging as hf_logging
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update({k: "1" for k in saved})
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Loading weights" bar in the middle of a capture
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _config(path: Path, transformers: Any) -> Any:
    """The model config from a directory or a config JSON file."""
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise WorkloadError(f"hf:{path}: no config.json there; point at a checkpoint directory "
                            "or a config.json")
    try:
        obj = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise WorkloadError(f"hf:{path}: cannot read {file.name}: {err}") from err
    model_type = obj.get("model_type") if isinstance(obj, dict) else None
    if not model_type:
        raise WorkloadError(f"hf:{path}: {file.name} has no model_type; it must be a transformers "
                            "config (save one with config.save_pretrained(DIR))")
    try:
        config_class = transformers.CONFIG_MAPPING[model_type]
    except KeyError:
        raise WorkloadError(f"hf:{path}: model_type {model_type!r} is not known to transformers "
                            f"{transformers.__version__}") from None
    return config_class.from_dict(obj)


def _model_class(config: Any, transformers: Any) -> Any:
    """The config's own architecture when it names one, else a causal-LM head, else the bare model."""
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    for auto in ("AutoModelForCausalLM", "AutoModel"):
        mapping = getattr(transformers, auto)._model_mapping
        if type(config) in mapping:
            return mapping[type(config)]
    raise WorkloadError(f"hf: no model class for {type(config).__name__}; name one in the "
                        "config's 'architectures'")


def _inputs(path: Path, config: Any, transformers: Any, *, batch_size: int, seq_len: int,
            seed: int) -> Dict[str, torch.Tensor]:
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab <= 0:
        raise WorkloadError(f"hf:{path}: the config has no vocab_size; only text models are supported")
    directory = path if path.is_dir() else path.parent
    if any((directory / f).is_file() for f in TOKENIZER_FILES):
        try:
            tok = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except Exception as err:  # a damaged or partial tokenizer is the user's to fix
            raise WorkloadError(f"hf:{path}: loading the tokenizer failed: {type(err).__name__}: {err}") from err
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token or tok.unk_token
        texts = [EXAMPLE_TEXT[i % len(EXAMPLE_TEXT)] for i in range(batch_size)]
        enc = tok(texts, return_tensors="pt", padding="max_length", truncation=True, max_length=seq_len)
        ids = enc["input_ids"].clamp(0, vocab - 1)  # a tokenizer may know more ids than a tiny config
        mask = enc.get("attention_mask", torch.ones_like(ids))
    else:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (batch_size, seq_len), generator=gen)
        mask = torch.ones_like(ids)
    return {"input_ids": ids, "attention_mask": mask}


def _bare_loss(out: Any) -> torch.Tensor:
    hidden = out["last_hidden_state"] if isinstance(out, dict) else out[0]
    return hidden.float().pow(2).mean()


def _model_loss(out: Any) -> torch.Tensor:
    return out["loss"] if isinstance(out, dict) else out[0]


class HFParts(NamedTuple):
    """What :func:`build_hf` builds: ``Workload(*parts)`` is the workload."""

    model: torch.nn.Module
    inputs: Dict[str, torch.Tensor]
    loss: Callable[[Any], torch.Tensor]


def build_hf(source: "str | os.PathLike", *, batch_size: int = 2, seq_len: int = 16, seed: int = 0,
             attn_implementation: Optional[str] = "eager") -> HFParts:
    """Build a transformers model, its example inputs and its loss from local files (no download).

    ``load_workload("hf:PATH")`` calls it (seeded) and wraps the parts in a ``Workload``.

    Args:
        source: a checkpoint directory, a directory holding only ``config.json``, or a config
            JSON file (random weights for the last two).
        batch_size, seq_len: the shape of the token ids.
        seed: the seed of the random token ids (when no tokenizer is stored).
        attn_implementation: passed to transformers (``"eager"``, ``"sdpa"``; None: its default).

    Returns:
        ``(model, inputs, loss)``: the model on the CPU in float32, ``input_ids`` and
        ``attention_mask`` (and ``labels`` for heads that compute their own loss), the loss.

    Raises:
        WorkloadError: transformers is missing, the path holds no config, or loading fails.

    Example:
        >>> model, inputs, loss = build_hf("checkpoints/tiny-llama")  # doctest: +SKIP
    """
    transformers = _require_transformers()
    path = Path(source).expanduser()
    if not path.exists():
        raise WorkloadError(f"hf:{source}: no such file or directory")
    with _offline():
        config = _config(path, transformers)
        if attn_implementation is not None:
            config._attn_implementation = attn_implementation
        cls = _model_class(config, transformers)
        has_weights = path.is_dir() and any((path / f).is_file() for f in WEIGHT_FILES)
        try:
            if has_weights:
                model = cls.from_pretrained(str(path), config=config, local_files_only=True)
            else:
                model = cls._from_config(config)
        except Exception as err:
            raise WorkloadError(f"hf:{source}: building {cls.__name__} failed: "
                                f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from err
        inputs = _inputs(path, config, transformers, batch_size=batch_size, seq_len=seq_len, seed=seed)
    model = model.float()
    head = cls.__name__
    loss = _model_loss
    if head.endswith(("ForCausalLM", "LMHeadModel", "ForMaskedLM")):
        inputs["labels"] = inputs["input_ids"].clone()
    elif head.endswith("ForSequenceClassification"):
        inputs["labels"] = torch.zeros(batch_size, dtype=torch.long)
        if getattr(model.config, "pad_token_id", None) is None:
            model.config.pad_token_id = 0  # classification pools the last non-pad token
    else:
        loss = _bare_loss
    return HFParts(model, inputs, loss)
