"""The fused statistics kernel's ``*_at`` entry points (:mod:`._stats_jit`) compiled as C functions
(``numba.cfunc``), for the compiled capture engine's hook (csrc/op_hook.cpp), which calls them by
address. Their own module: compiling them costs ~10 s once (then numba's cache), which only that
engine should pay. They run the same compiled ``_stats`` as the entry points the Python path
calls (tests/capture/test_compiled_engine.py checks the results bit for bit)."""
from __future__ import annotations

import numba

from ._stats_jit import stats_bf16_at, stats_f16_at, stats_f32_at, stats_f64_at

_C_SIGNATURE = "void(int64, int64, int64, int64, int64, int64, int64)"
cstats_f32 = numba.cfunc(_C_SIGNATURE, cache=True)(stats_f32_at.py_func)
cstats_f64 = numba.cfunc(_C_SIGNATURE, cache=True)(stats_f64_at.py_func)
cstats_bf16 = numba.cfunc(_C_SIGNATURE, cache=True)(stats_bf16_at.py_func)
cstats_f16 = numba.cfunc(_C_SIGNATURE, cache=True)(stats_f16_at.py_func)
