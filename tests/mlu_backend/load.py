"""Importing this module registers the stand-in accelerator as ``mlu`` (see the package docstring).

``PRECISIONDIFF_IMPORT=tests.mlu_backend.load precisiondiff capture ... --target mlu/bf16``
"""
from . import register

register()
