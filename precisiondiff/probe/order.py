"""The order of a summation, revealed from outside (FPRev, 2024).

For a pair of positions (i, j) a row holds ``+M`` at i, ``-M`` at j and a small ``s`` everywhere
else, with ``M`` so large that the accumulator absorbs every partial sum of ``s`` added to it.
The ``s`` terms that join ``M`` before ``-M`` cancels it vanish; the others survive. So the
result is ``s * (K - size(i, j))`` where ``size(i, j)`` is the number of terms under the node
of the summation tree where i and j first meet. Those sizes, for a few hundred pairs, are
compared with the trees of known orders:

- ``sequential``: ((t0 + t1) + t2) + ...;
- ``pairwise``: recursive halving, as a tree reduction;
- ``blocked B``: sequential inside contiguous blocks of B terms, blocks then summed in order
  (or pairwise: ``blocked B, pairwise across``);
- ``strided L``: L lanes (term i goes to lane i mod L, as in a vectorised loop), each lane
  sequential, lanes then combined by halving, adjacent pairs or in order.

Run at K = 64 and K = 256, the block size tells *blocked B* (B fixed, sequential while K <= B)
from *split-K S* (K / B fixed). An order that matches none is reported as ``unrecognised``
with the sizes of the subtrees holding term 0 (its *spine*).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..comparators.ulp import float_format
from .kernels import Kernels, dot

__all__ = ["reveal", "summation_order", "lca_sizes", "hypotheses"]

Tree = object  # an int (a term) or a tuple of two trees


def _chain(items: Sequence[Tree]) -> Tree:
    tree = items[0]
    for item in items[1:]:
        tree = (tree, item)
    return tree


def _halving(items: Sequence[Tree]) -> Tree:
    if len(items) == 1:
        return items[0]
    mid = (len(items) + 1) // 2
    return (_halving(items[:mid]), _halving(items[mid:]))


def _lanes_halving(items: Sequence[Tree]) -> Tree:
    # horizontal reduction of a vector register: lane l + lane l + L/2, repeated
    while len(items) > 1:
        half = len(items) // 2
        items = [(items[i], items[i + half]) for i in range(half)]
    return items[0]


def _adjacent(items: Sequence[Tree]) -> Tree:
    while len(items) > 1:
        items = [(items[i], items[i + 1]) for i in range(0, len(items), 2)]
    return items[0]


def hypotheses(n: int) -> Dict[str, Tuple[str, int, Tree]]:
    """Known summation trees over n terms (n a power of two): name -> (kind, block, tree)."""
    terms = list(range(n))
    out: Dict[str, Tuple[str, int, Tree]] = {"sequential": ("sequential", n, _chain(terms)),
                                             "pairwise": ("pairwise", 0, _halving(terms))}
    b = 2
    while b < n:
        blocks = [_chain(terms[s:s + b]) for s in range(0, n, b)]
        out[f"blocked {b}"] = ("blocked", b, _chain(blocks))
        out[f"blocked {b}, pairwise across"] = ("blocked-pairwise", b, _halving(blocks))
        lanes = [_chain(terms[lane::b]) for lane in range(b)]
        out[f"strided {b} lanes, halving"] = ("strided", b, _lanes_halving(lanes))
        out[f"strided {b} lanes, adjacent pairs"] = ("strided-adjacent", b, _adjacent(lanes))
        out[f"strided {b} lanes, in order"] = ("strided-sequential", b, _chain(lanes))
        b *= 2
    return out


def lca_sizes(tree: Tree, n: int) -> torch.Tensor:
    """n x n matrix: the number of terms under the node where terms i and j first meet."""
    nodes: List[List[int]] = []

    def walk(t: Tree) -> List[int]:
        if isinstance(t, int):
            return [t]
        leaves = walk(t[0]) + walk(t[1])
        nodes.append(leaves)
        return leaves

    walk(tree)
    sizes = torch.full((n, n), n, dtype=torch.int64)
    for leaves in sorted(nodes, key=len, reverse=True):
        idx = torch.tensor(leaves)
        sizes[idx[:, None], idx[None, :]] = len(leaves)
    return sizes


def _pairs(n: int) -> List[Tuple[int, int]]:
    pairs = {(0, j) for j in range(1, n)} | {(1, j) for j in range(2, n)}
    pairs |= {(i, i + 1) for i in range(n - 1)} | {(i, i + n // 2) for i in range(n // 2)}
    return sorted(pairs)


def _magnitudes(k: Kernels, family: str, n: int, bits: Optional[int]) -> Optional[Tuple[float, float, float]]:
    """``(s, M_a, M_b)``: the small term and M as a product ``M_a * M_b`` (M_b = 1 unless the
    family takes a second operand and M is out of the dtype's range), or None."""
    fmt = float_format(k.dtype)
    emax = math.frexp(fmt.max_finite)[1] - 1
    need = (bits or 53) + int(math.log2(n)) + 2
    s_exp = max(fmt.emin, -need // 2) if emax < 64 else 0
    m_exp = s_exp + need
    if m_exp <= emax:
        return 2.0 ** s_exp, 2.0 ** m_exp, 1.0
    if family in ("gemm", "bmm") and m_exp <= 2 * emax:
        return 2.0 ** s_exp, 2.0 ** emax, 2.0 ** (m_exp - emax)
    return None


def summation_order(k: Kernels, family: str, n: int, bits: Optional[int]) -> Tuple[Optional[str], str]:
    """The order of one K = n summation: a hypothesis name (None when it cannot be revealed),
    and the evidence."""
    mags = _magnitudes(k, family, n, bits)
    if mags is None:
        return None, f"{k.dtype} has too little range to absorb {n} terms in {bits}-bit sums"
    s, ma, mb = mags
    pairs = _pairs(n)
    a = torch.full((len(pairs), n), s, dtype=torch.float64)
    b = torch.ones_like(a) if mb != 1.0 else None
    for r, (i, j) in enumerate(pairs):
        a[r, i], a[r, j] = ma, -ma
        if b is not None:
            b[r, i] = b[r, j] = mb
    res = dot(k, family, a, b)
    measured = n - res / s
    if not bool(torch.isfinite(measured).all()) or bool((measured != measured.round()).any()):
        return "unrecognised", f"results are not whole multiples of s={s:g}: M is not absorbed"
    pi = torch.tensor([p[0] for p in pairs])
    pj = torch.tensor([p[1] for p in pairs])
    measured = measured.to(torch.int64)
    for name, (_, _, tree) in hypotheses(n).items():
        if torch.equal(lca_sizes(tree, n)[pi, pj], measured):
            return name, f"{len(pairs)} pairs (+M, -M) in {n} terms match {name}"
    spine = sorted(set(measured[: n - 1].tolist()))
    return "unrecognised", f"K={n}: subtrees holding term 0 have {_ranges(spine)} terms"


def _ranges(values: List[int]) -> str:
    runs: List[List[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def reveal(k: Kernels, family: str, bits: Optional[int], sizes: Sequence[int] = (64, 256)) -> Tuple[str, str]:
    """The summation order over several K, summarised: ``sequential``, ``pairwise``,
    ``blocked B``, ``split-K S``, ``strided L lanes, ...``, ``shape-dependent: ...``,
    ``unrecognised`` or ``not revealed``."""
    found = {n: summation_order(k, family, n, bits) for n in sizes}
    names = {n: v[0] for n, v in found.items() if v[0] is not None}
    evidence = "; ".join(f"K={n}: {v[0] or 'not revealed'}" for n, v in found.items())
    if not names:
        return "not revealed", next(iter(found.values()))[1]
    if set(names.values()) == {"unrecognised"}:
        return "unrecognised", "; ".join(v[1] for v in found.values())
    hyps = {n: hypotheses(n).get(name) for n, name in names.items()}
    if len(set(names.values())) == 1 and all(h is not None and h[0] != "blocked" for h in hyps.values()):
        return next(iter(names.values())), evidence
    blocks = {n: (h[1] if h[0] in ("blocked", "sequential") else None) for n, h in
              ((n, h) for n, h in hyps.items() if h is not None)}
    if len(blocks) == len(names) and None not in blocks.values():
        biggest = max(blocks)
        fixed = blocks[biggest]
        if fixed < biggest and all(b == min(fixed, n) for n, b in blocks.items()):
            return f"blocked {fixed}", evidence
        splits = {n // b for n, b in blocks.items()}
        if len(splits) == 1 and len(blocks) > 1 and splits != {1}:
            return f"split-K {splits.pop()}", evidence
        if all(b == n for n, b in blocks.items()):
            return "sequential", evidence
    if len(set(names.values())) == 1 and len(names) == 1:
        return next(iter(names.values())), evidence
    return "shape-dependent: " + evidence, evidence
