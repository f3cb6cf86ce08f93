"""Catch rate of the op verdict on planted wrong bf16 kernels of ~30 stock ops.

Every op is written once as a *kernel* that computes in float32 (float64 on the golden run) with
hook points: its final rounding, one intermediate, its sums, its transcendental functions. A
*plant* replaces one hook on the bf16 path only (a real bf16 kernel's bug):

* ``rtz``: the output rounded toward zero instead of to nearest;
* ``trunc``: one intermediate truncated to bf16;
* ``accum``: every sum accumulated in bf16, one term at a time;
* ``plus2``: +2 ULP on 10 % of the elements (a fixed pseudo-random mask);
* ``approx``: low-degree approximations of exp/log/tanh/sigmoid/erf/rsqrt;
* ``ftz``: subnormal outputs flushed to zero (reported, not a goal).

Each plant is judged by ``precisiondiff.testing.parity.check_op(fn, *inputs, target="cpu/bf16")``
as a plain Python function and as a ``torch.library`` custom op. A plant is *eligible* when its
error is at least 2x the correct kernel's (rel-L2, or an element 4x worse in ULP of the element);
the catch rate is over eligible plants. The correct kernel (``none``) is judged too: a blame there
is a false alarm on a correct kernel.

    PYTHONPATH=. python benchmarks/bench_plants.py [--ops mm,softmax] [--classes rtz,accum] [--seeds 2] [--json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from precisiondiff.comparators.peers import element_scale  # noqa: E402
from precisiondiff.comparators.ulp import ulp_spacing  # noqa: E402
from precisiondiff.testing.parity import check_op  # noqa: E402

LOW = (torch.bfloat16, torch.float16)
CLASSES = ("none", "rtz", "trunc", "accum", "plus2", "approx", "ftz")


def _trunc_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bf16 rounding toward zero (drop the low 16 bits)."""
    bits = x.float().contiguous().view(torch.int32) & -65536
    return bits.view(torch.float32).to(torch.bfloat16)


def _fit(fn: Callable[[np.ndarray], np.ndarray], lo: float, hi: float, deg: int) -> np.ndarray:
    xs = np.linspace(lo, hi, 257)
    return np.polyfit(xs, fn(xs), deg)


_EXP2 = _fit(np.exp2, 0.0, 1.0, 2)
_LOG2 = _fit(lambda m: np.log2(1 + m), 0.0, 1.0, 2)


def _poly(c: np.ndarray, x: torch.Tensor) -> torch.Tensor:
    y = torch.zeros_like(x)
    for a in c:
        y = y * x + float(a)
    return y


def _exp_approx(x):
    t = x * math.log2(math.e)
    n = torch.floor(t)
    return torch.ldexp(_poly(_EXP2, t - n), n.clamp(-126, 127).to(torch.int32))


def _log_approx(x):
    m, e = torch.frexp(x)  # x = m 2^e, m in [0.5, 1)
    return ((e - 1).to(x.dtype) + _poly(_LOG2, 2 * m - 1)) * math.log(2)


def _tanh_approx(x):
    x = x.clamp(-3, 3)
    return x * (27 + x * x) / (27 + 9 * x * x)


def _rsqrt_approx(x):
    i = 0x5F3759DF - (x.float().contiguous().view(torch.int32) >> 1)
    y = i.view(torch.float32).to(x.dtype)
    return y * (1.5 - 0.5 * x * y * y)


def _erf_approx(x):
    return _tanh_approx(1.1283791671 * x * (1 + 0.0895 * x * x))


EXACT = {"exp": torch.exp, "log": torch.log, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
         "erf": torch.erf, "rsqrt": torch.rsqrt}
APPROX = {"exp": _exp_approx, "log": _log_approx, "tanh": _tanh_approx,
          "sigmoid": lambda x: 0.5 + 0.5 * _tanh_approx(0.5 * x), "erf": _erf_approx, "rsqrt": _rsqrt_approx}


class Kit:
    """The hooks of a kernel for inputs of dtype ``dt`` under plant ``plant`` (bf16/fp16 only)."""

    def __init__(self, dt: torch.dtype, plant: str):
        self.dt = dt
        self.low = dt in LOW
        self.plant = plant if self.low else "none"
        self.cdt = torch.float32 if self.low or dt == torch.float32 else dt
        self.used: set = set()

    def up(self, x):
        return x.to(self.cdt)

    def mid(self, x):
        self.used.add("trunc")
        if self.plant == "trunc":
            return _trunc_bf16(x).to(self.cdt)
        return x

    def f(self, name, x):
        self.used.add("approx")
        return (APPROX if self.plant == "approx" else EXACT)[name](x)

    def sum(self, x, dim, keepdim=False):
        self.used.add("accum")
        if self.plant != "accum":
            return x.sum(dim, keepdim=keepdim)
        dim = dim % x.dim()
        acc = torch.zeros_like(x.select(dim, 0), dtype=self.dt)
        for i in range(x.shape[dim]):
            acc = (acc.to(self.cdt) + x.select(dim, i)).to(self.dt)
        acc = acc.to(self.cdt)
        return acc.unsqueeze(dim) if keepdim else acc

    def mean(self, x, dim, keepdim=False):
        return self.sum(x, dim, keepdim) / x.shape[dim]

    def cumsum(self, x, dim):
        self.used.add("accum")
        if self.plant != "accum":
            return x.cumsum(dim)
        outs, acc = [], torch.zeros_like(x.select(dim, 0), dtype=self.dt)
        for i in range(x.shape[dim]):
            acc = (acc.to(self.cdt) + x.select(dim, i)).to(self.dt)
            outs.append(acc.to(self.cdt))
        return torch.stack(outs, dim)

    def out(self, y):
        if self.plant == "rtz" and self.dt == torch.bfloat16:
            return _trunc_bf16(y)
        r = y.to(self.dt)
        if self.plant == "plus2":
            idx = torch.arange(r.numel()).reshape(r.shape)
            mask = (idx * 2654435761 % 1000) < 100
            return torch.where(mask, r.double() + 2 * ulp_spacing(r.double(), self.dt), r.double()).to(self.dt)
        if self.plant == "ftz":
            return torch.where(r.abs() < torch.finfo(self.dt).tiny, torch.zeros_like(r), r)
        return r


def _mm(k, a, b):
    return k.sum(k.mid(k.up(a)[..., :, :, None] * k.up(b)[..., None, :, :]), -2)


def _layer_norm(k, x, w, b):
    x = k.up(x)
    c = k.mid(x - k.mean(x, -1, True))
    return c * k.f("rsqrt", k.mean(c * c, -1, True) + 1e-5) * k.up(w) + k.up(b)


def _conv1d(k, x, w):
    xu = k.up(x).unfold(-1, w.shape[-1], 1)  # (N, C, L, kw)
    prod = k.up(w)[None, :, :, None, :] * xu[:, None]  # (N, O, C, L, kw)
    return k.sum(k.mid(prod.transpose(2, 3).flatten(-2)), -1)


def _conv2d(k, x, w):
    cols = F.unfold(k.up(x), w.shape[-1])  # (N, C*kh*kw, L)
    wf = k.up(w).flatten(1)  # (O, C*kh*kw)
    y = k.sum(k.mid(wf[None, :, :, None] * cols[:, None, :, :]), 2)
    side = x.shape[-1] - w.shape[-1] + 1
    return y.reshape(x.shape[0], w.shape[0], side, side)


def _softplus(k, x):
    x = k.up(x)
    return torch.where(x > 20, x, k.f("log", 1 + k.mid(k.f("exp", x))))


def _log_softmax(k, x):
    x = k.up(x)
    s = k.mid(x - x.amax(-1, keepdim=True))
    return s - k.f("log", k.sum(k.f("exp", s), -1, True))


def _group_norm(k, x, w, b):
    n, c, h = x.shape
    xg = k.up(x).reshape(n, 4, -1)
    d = k.mid(xg - k.mean(xg, -1, True))
    y = (d * k.f("rsqrt", k.mean(d * d, -1, True) + 1e-5)).reshape(n, c, h)
    return y * k.up(w)[:, None] + k.up(b)[:, None]


def _r(*shape, scale=1.0, pos=False):
    def make(g):
        x = torch.randn(*shape, generator=g, dtype=torch.float64) * scale
        return x.abs() + 0.05 if pos else x
    return make


#: name -> (kernel(k, *inputs), input makers)
OPS: Dict[str, Any] = {
    "mm": (lambda k, a, b: _mm(k, a, b), [_r(32, 256), _r(256, 32)]),
    "mm_k16": (lambda k, a, b: _mm(k, a, b), [_r(64, 16), _r(16, 64)]),
    "bmm": (lambda k, a, b: _mm(k, a, b), [_r(4, 16, 64), _r(4, 64, 16)]),
    "addmm": (lambda k, c, a, b: k.up(c) + _mm(k, a, b), [_r(32), _r(32, 128), _r(128, 32)]),
    "linear": (lambda k, x, w, b: _mm(k, x, w.t()) + k.up(b), [_r(64, 96), _r(48, 96), _r(48)]),
    "mv": (lambda k, a, v: _mm(k, a, v[:, None])[:, 0], [_r(256, 128), _r(128)]),
    "conv1d": (_conv1d, [_r(4, 8, 40), _r(16, 8, 5)]),
    "conv2d": (_conv2d, [_r(2, 8, 12, 12), _r(16, 8, 3, 3)]),
    "sum": (lambda k, x: k.sum(k.mid(k.up(x)), -1), [_r(64, 512)]),
    "sum_k9": (lambda k, x: k.sum(k.mid(k.up(x)), -1), [_r(512, 9)]),
    "mean": (lambda k, x: k.mean(k.mid(k.up(x)), -1), [_r(128, 256)]),
    "var": (lambda k, x: k.mean(k.mid(k.up(x) - k.mean(k.up(x), -1, True)) ** 2, -1) * 256 / 255, [_r(128, 256)]),
    "norm": (lambda k, x: k.sum(k.mid(k.up(x) ** 2), -1).sqrt(), [_r(128, 256)]),
    "logsumexp": (lambda k, x: (lambda m: m[..., 0] + k.f("log", k.sum(k.f("exp", k.mid(k.up(x) - m)), -1)))(
        k.up(x).amax(-1, keepdim=True)), [_r(128, 128, scale=3)]),
    "cumsum": (lambda k, x: k.cumsum(k.mid(k.up(x)), -1), [_r(64, 64)]),
    "layer_norm": (_layer_norm, [_r(64, 256), _r(256), _r(256)]),
    "rms_norm": (lambda k, x, w: k.mid(k.up(x)) * k.f("rsqrt", k.mean(k.up(x) ** 2, -1, True) + 1e-6) * k.up(w),
                 [_r(64, 256), _r(256)]),
    "group_norm": (_group_norm, [_r(8, 16, 64), _r(16), _r(16)]),
    "normalize": (lambda k, x: k.up(x) * k.f("rsqrt", k.sum(k.mid(k.up(x) ** 2), -1, True)), [_r(128, 128)]),
    "softmax": (lambda k, x: (lambda e: e / k.sum(e, -1, True))(
        k.f("exp", k.mid(k.up(x) - k.up(x).amax(-1, keepdim=True)))), [_r(128, 128, scale=3)]),
    "log_softmax": (_log_softmax, [_r(128, 128, scale=3)]),
    "exp": (lambda k, x: k.f("exp", k.mid(k.up(x))), [_r(8192, scale=3)]),
    "log": (lambda k, x: k.f("log", k.mid(k.up(x))), [_r(8192, scale=3, pos=True)]),
    "tanh": (lambda k, x: k.f("tanh", k.mid(k.up(x))), [_r(8192)]),
    "sigmoid": (lambda k, x: k.f("sigmoid", k.mid(k.up(x))), [_r(8192, scale=3)]),
    "gelu": (lambda k, x: (lambda v: 0.5 * v * (1 + k.f("erf", k.mid(v * 0.7071067811865476))))(k.up(x)),
             [_r(8192, scale=2)]),
    "silu": (lambda k, x: (lambda v: v * k.mid(k.f("sigmoid", v)))(k.up(x)), [_r(8192, scale=3)]),
    "rsqrt": (lambda k, x: k.f("rsqrt", k.mid(k.up(x))), [_r(8192, pos=True)]),
    "softplus": (_softplus, [_r(8192, scale=3)]),
    "avg_pool2d": (lambda k, x: k.sum(k.mid(k.up(x).unfold(-2, 3, 1).unfold(-2, 3, 1).flatten(-2)), -1) / 9,
                   [_r(4, 8, 18, 18)]),
    "avg_pool1d": (lambda k, x: k.sum(k.mid(k.up(x).unfold(-1, 4, 4)), -1) / 4, [_r(16, 8, 256)]),
    "mul_subnormal": (lambda k, a, b: k.mid(k.up(a)) * k.up(b), [_r(4096, scale=1e-20), _r(4096, scale=1e-19)]),
}


def plant_fn(op: str, plant: str) -> Callable[..., torch.Tensor]:
    """The kernel of ``op`` with ``plant`` on its low-precision path, as a plain function."""
    kernel = OPS[op][0]

    def fn(*xs):
        k = Kit(xs[0].dtype, plant)
        return k.out(kernel(k, *xs))
    fn.__name__ = f"{op}_{plant}"
    return fn


def applies(op: str, plant: str) -> bool:
    """Whether ``op``'s kernel has the hook ``plant`` replaces."""
    if plant in ("none", "rtz", "plus2", "ftz"):
        return True
    kernel, makers = OPS[op]
    k = Kit(torch.bfloat16, "none")
    g = torch.Generator().manual_seed(0)
    kernel(k, *[m(g).to(torch.bfloat16) for m in makers])
    return plant in k.used


_REGISTERED: Dict[str, Callable[..., torch.Tensor]] = {}
_KEEP: List[Any] = []


def plant_custom_op(op: str, plant: str) -> Callable[..., torch.Tensor]:
    """The same kernel registered as ``plants::<op>_<plant>`` (a torch.library custom op)."""
    name = f"{op}_{plant}"
    if name not in _REGISTERED:
        inner = plant_fn(op, plant)

        @torch.library.custom_op(f"plants::{name}", mutates_args=())
        def custom(xs: List[torch.Tensor]) -> torch.Tensor:
            return inner(*xs).clone()

        @custom.register_fake
        def _(xs):
            return inner(*[torch.zeros(x.shape, dtype=x.dtype) for x in xs])
        _KEEP.append(custom)  # a collected CustomOpDef leaves a dangling kernel (a segfault)
        _REGISTERED[name] = lambda *xs: getattr(torch.ops.plants, name)(list(xs))
    return _REGISTERED[name]


def errors(out: torch.Tensor, golden: torch.Tensor):
    """(rel-L2, max error in ULP of the element) of ``out`` against ``golden``, finite elements
    (also used by bench_op_sweep.py)."""
    d, g = out.double().flatten(), golden.double().flatten()
    ok = torch.isfinite(d) & torch.isfinite(g)
    d, g = d[ok], g[ok]
    gn = float(g.norm())
    rel = float((d - g).norm()) / gn if gn else float((d - g).norm())
    unit = element_scale(g, out.dtype)
    return rel, float(((d - g).abs() / unit).max()) if d.numel() else 0.0


def run(ops, plants, seeds: int):
    rows = []
    for op in ops:
        kernel, makers = OPS[op]
        for plant in plants:
            if not applies(op, plant):
                continue
            for seed in range(seeds):
                g = torch.Generator().manual_seed(1000 + seed)
                inputs = [m(g) for m in makers]
                lows = [x.to(torch.bfloat16) for x in inputs]
                golden = plant_fn(op, "none")(*[x.double() for x in lows])
                rel_ok, max_ok = errors(plant_fn(op, "none")(*lows), golden)
                rel_p, max_p = errors(plant_fn(op, plant)(*lows), golden)
                eligible = plant != "none" and (rel_p >= 2 * rel_ok or max_p >= 4 * max(max_ok, 0.5))
                for form, fn in (("function", plant_fn(op, plant)), ("custom_op", plant_custom_op(op, plant))):
                    start = time.perf_counter()
                    r = check_op(fn, *inputs, target="cpu/bf16")
                    msg = next((c.message for c in r.checks if not c.passed), "")
                    rows.append({"op": op, "plant": plant, "seed": seed, "form": form, "blamed": not r.passed,
                                 "eligible": eligible, "rel_l2": rel_p, "rel_l2_correct": rel_ok,
                                 "max_ulp": max_p, "max_ulp_correct": max_ok,
                                 "seconds": time.perf_counter() - start, "message": msg.splitlines()[0] if msg else ""})
    return rows


def table(rows) -> str:
    """Markdown table: per plant class and form, caught / eligible (and blamed / all)."""
    lines = ["| plant | as a function: caught / eligible | as a custom op: caught / eligible | blamed / all (both forms) |",
             "|---|---|---|---|"]
    for plant in CLASSES:
        sel = [r for r in rows if r["plant"] == plant]
        if not sel:
            continue
        cells = []
        for form in ("function", "custom_op"):
            el = [r for r in sel if r["form"] == form and (r["eligible"] or plant == "none")]
            caught = sum(r["blamed"] for r in el)
            cells.append(f"{caught} / {len(el)} ({100 * caught / len(el):.0f} %)" if el else "-")
        cells.append(f"{sum(r['blamed'] for r in sel)} / {len(sel)}")
        lines.append(f"| {plant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default=",".join(OPS), help="comma-separated op names (default: all)")
    ap.add_argument("--classes", default=",".join(CLASSES), help="comma-separated plant classes")
    ap.add_argument("--seeds", type=int, default=2, help="input draws per (op, plant)")
    ap.add_argument("--json", action="store_true", help="print every row as JSON")
    ap.add_argument("--misses", action="store_true", help="list eligible plants not caught and blamed correct kernels")
    args = ap.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    plants = [p for p in args.classes.split(",") if p]
    bad = [o for o in ops if o not in OPS] + [p for p in plants if p not in CLASSES]
    if bad:
        print(f"unknown op or class: {', '.join(bad)}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows = run(ops, plants, args.seeds)
    if args.json:
        print(json.dumps(rows, indent=1))
    print(f"{len(ops)} ops, classes {','.join(plants)}, {args.seeds} seeds, {len(rows)} judgements, "
          f"{time.perf_counter() - start:.0f} s")
    print(table(rows))
    if args.misses:
        for r in rows:
            if (r["eligible"] and not r["blamed"]) or (r["plant"] == "none" and r["blamed"]):
                print(f"{'MISS' if r['eligible'] else 'FALSE'} {r['op']} {r['plant']} {r['form']} seed {r['seed']}: "
                      f"rel {r['rel_l2']:.3g} vs {r['rel_l2_correct']:.3g}, max {r['max_ulp']:.3g} vs "
                      f"{r['max_ulp_correct']:.3g} ULP {r['message'][:160]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
