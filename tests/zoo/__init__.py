"""The model zoo: small random-initialised Hugging Face transformers models (see models.py).

``ZOO`` maps a short name to a builder returning :class:`precisiondiff.Workload`; each builder is
also usable from the CLI as ``tests/zoo/models.py:build_NAME``.
"""
from .models import (build_bert, build_convnext, build_gpt2, build_llama, build_mixtral, build_resnet,
                     build_t5, build_vit)

ZOO = {
    "llama": build_llama,
    "gpt2": build_gpt2,
    "bert": build_bert,
    "t5": build_t5,
    "vit": build_vit,
    "mixtral": build_mixtral,
    "resnet": build_resnet,
    "convnext": build_convnext,
}

__all__ = ["ZOO"]
