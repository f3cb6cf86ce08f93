"""By-hand checks of the stock CPU kernels that the peer rule still names (docs/bisect.md,
"Findings on stock kernels"): each kernel in bf16 against a float64 replay of the same bf16
inputs, beside float32 arithmetic rounded once (what a correct bf16 kernel gives), and the peer
rule's verdict. Run it under each CPU path:

    ATEN_CPU_CAPABILITY=default|avx2 PYTHONPATH=. python benchmarks/stock_findings.py
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from precisiondiff.comparators import ulp_error
from precisiondiff.comparators.peers import judge_against_peers


def _rel(t: torch.Tensor, gold: torch.Tensor) -> float:
    return float((t.double() - gold).norm() / gold.norm())


def layer_norm_backward() -> None:
    gen = torch.Generator().manual_seed(0)
    for rows, cols in ((24, 64), (128, 64), (512, 32), (2048, 64)):
        x = torch.randn(rows, cols, generator=gen).bfloat16()
        dy = torch.randn(rows, cols, generator=gen).bfloat16()
        w = (torch.rand(cols, generator=gen) + 0.5).bfloat16()
        b = torch.randn(cols, generator=gen).bfloat16()

        def run(dt):
            _, mean, rstd = torch.ops.aten.native_layer_norm(x.to(dt), [cols], w.to(dt), b.to(dt), 1e-5)
            return torch.ops.aten.native_layer_norm_backward(dy.to(dt), x.to(dt), [cols], mean, rstd, w.to(dt),
                                                             b.to(dt), [True, True, True])
        kernel, fp32, fp64 = run(torch.bfloat16), run(torch.float32), run(torch.float64)
        for i, name in ((1, "grad_weight"), (2, "grad_bias")):
            peer = fp32[i].bfloat16()
            v = judge_against_peers(kernel[i], fp64[i], {"float32": peer})
            print(f"  layer_norm_backward {rows}x{cols} {name}: rel-L2 kernel {_rel(kernel[i], fp64[i]):.2e}, "
                  f"fp32 rounded once {_rel(peer, fp64[i]):.2e} (x{_rel(kernel[i], fp64[i]) / _rel(peer, fp64[i]):.1f}); "
                  f"max ULP {ulp_error(kernel[i], fp64[i], torch.bfloat16).abs().max():.1f} vs "
                  f"{ulp_error(peer, fp64[i], torch.bfloat16).abs().max():.2f}; peer rule: "
                  f"{'pass' if v.passed else 'FAIL'}")
    # the same sum done by the stock bf16 sum kernel: fp32 accumulation, one rounding
    dy = torch.randn(2048, 64, generator=gen).bfloat16()
    print(f"  for comparison, stock bf16 dy.sum(0) over 2048 rows: rel-L2 {_rel(dy.sum(0), dy.double().sum(0)):.2e}")


def embedding_backward() -> None:
    gen = torch.Generator().manual_seed(0)
    for seed in range(3):  # the bf16 running sum, bit for bit (KNOWN_FINDINGS)
        g = (torch.randn(24, 128, generator=torch.Generator().manual_seed(seed)) * 1e-3).bfloat16()
        out = torch.ops.aten.embedding_dense_backward(g, torch.zeros(24, dtype=torch.long), 2, -1, False)[0]
        run = torch.zeros(128, dtype=torch.bfloat16)
        for row in g:
            run = (run.float() + row.float()).bfloat16()
        gold = g.double().sum(0)
        rel = lambda a: float((a.double() - gold).norm() / gold.norm())  # noqa: E731
        print(f"  embedding_dense_backward, one token x24 rows of 128, seed {seed}: rel-L2 kernel {rel(out):.2e}, "
              f"fp32 rounded once {rel(g.float().sum(0).bfloat16()):.2e}; equals a bf16 running sum: "
              f"{torch.equal(out, run)}")
    for repeats in (3, 64, 1024):
        g = torch.randn(repeats, 8, generator=gen).bfloat16()
        idx = torch.zeros(repeats, dtype=torch.long)
        out = torch.ops.aten.embedding_dense_backward(g, idx, 4, -1, False)[0]
        gold = g.double().sum(0)
        peer = g.float().sum(0).bfloat16()
        v = judge_against_peers(out, gold, {"float32": peer}, magnitude=g.double().abs().sum(0), k=repeats)
        print(f"  embedding_dense_backward, one token x{repeats}: max ULP kernel "
              f"{ulp_error(out, gold, torch.bfloat16).abs().max():.1f}, fp32 rounded once "
              f"{ulp_error(peer, gold, torch.bfloat16).abs().max():.2f}; peer rule: {'pass' if v.passed else 'FAIL'}")


def foreach_mul_scalar_inplace() -> None:
    """SGD's momentum update: ``torch._foreach_mul_(bufs, 0.9)`` on bf16 buffers."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4096, generator=gen) * 1e-2).bfloat16()
    y = x.clone()
    torch._foreach_mul_([y], 0.9)
    gold = x.double() * 0.9
    spacing = 2.0 ** (torch.floor(torch.log2(gold.abs())) - 7)
    toward_zero = ((y.double() - gold) / spacing * gold.sign()).mean()
    scalar_in_bf16 = torch.equal(y, (x.double() * torch.tensor(0.9).bfloat16().double()).bfloat16())
    print(f"  _foreach_mul_(bf16, 0.9): equals x * bf16(0.9) rounded once: {scalar_in_bf16}; equals x * 0.9 "
          f"rounded once: {torch.equal(y, gold.bfloat16())}; out-of-place x * 0.9 does: "
          f"{torch.equal(x * 0.9, gold.bfloat16())}; mean error {-toward_zero:.3f} ULP toward zero")


def matrix_exp_bf16() -> None:
    """``torch.matrix_exp`` of the 4 x 4 identity in bf16 (e on the diagonal)."""
    m = torch.matrix_exp(torch.eye(4, dtype=torch.bfloat16))
    print(f"  matrix_exp(eye(4), bf16)[0, 0] = {m[0, 0].item():.4g} (float64: "
          f"{torch.matrix_exp(torch.eye(4, dtype=torch.float64))[0, 0].item():.6g}); NaN: {bool(m.isnan().any())}")


def div_trunc_bf16() -> None:
    """Vectorised ``div(rounding_mode="trunc")`` on bf16: every pair of integers 1..511 / 1..63."""
    xs = torch.arange(1, 512, dtype=torch.float32).bfloat16()
    ys = torch.arange(1, 64, dtype=torch.float32).bfloat16()
    x, y = (t.flatten().contiguous() for t in torch.meshgrid(xs, ys, indexing="ij"))
    vec = torch.div(x, y, rounding_mode="trunc")
    exact = torch.trunc(x.double() / y.double()).bfloat16()
    bad = vec != exact
    i = int(bad.nonzero()[0]) if bool(bad.any()) else 0
    one = torch.div(x[i:i + 1], y[i:i + 1], rounding_mode="trunc").item()
    print(f"  div(trunc, bf16): {int(bad.sum())} of {x.numel()} quotients wrong; e.g. {x[i].item():g} / {y[i].item():g}"
          f" = {x[i].item() / y[i].item():.4f}: vectorised {vec[i].item():g}, one element {one:g}, exact "
          f"{exact[i].item():g}")


def soft_margin_loss_fp16() -> None:
    """``soft_margin_loss`` in fp16 at x = -20, y = 1: log(1 + exp(20)) = 20."""
    x, t = torch.full((8,), -20.0, dtype=torch.float16), torch.ones(8, dtype=torch.float16)
    print(f"  soft_margin_loss(fp16, x=-20) = {F.soft_margin_loss(x, t).item()} (float64 "
          f"{F.soft_margin_loss(x.double(), t.double()).item():.6g}): exp(20) = 4.9e8 overflows fp16")


def grid_sample_bf16() -> None:
    """``grid_sample`` (bilinear) of a 64 x 64 map at 16 x 16 random points, bf16."""
    gen = torch.Generator().manual_seed(0)
    inp = torch.randn(1, 1, 64, 64, generator=gen).bfloat16()
    grid = (torch.rand(1, 16, 16, 2, generator=gen) * 2 - 1).bfloat16()
    gold = F.grid_sample(inp.double(), grid.double(), align_corners=False)
    once = F.grid_sample(inp.float(), grid.float(), align_corners=False).bfloat16()
    got = F.grid_sample(inp, grid, align_corners=False)
    print(f"  grid_sample(bf16): rel-L2 {_rel(got, gold):.3g} vs float32 rounded once {_rel(once, gold):.3g} "
          f"({_rel(got, gold) / _rel(once, gold):.0f}x)")


def addbmm_bf16() -> None:
    """``addbmm`` of 4 batches of (5 x 6) @ (6 x 5) onto a 5 x 5 bf16 matrix: is the running sum
    rounded to bf16 after each batch's product?"""
    same = []
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        m, b1, b2 = (torch.randn(*shape, generator=gen).bfloat16() for shape in ((5, 5), (4, 5, 6), (4, 6, 5)))
        acc = m.clone()
        for i in range(4):
            acc = (acc.float() + b1[i].float() @ b2[i].float()).bfloat16()
        same.append(torch.equal(acc, torch.addbmm(m, b1, b2)))
    print(f"  addbmm(bf16) equals a running sum rounded to bf16 after every batch: {sum(same)} of {len(same)} seeds")


def conv_backward_bf16() -> None:
    """The bf16 3x3 convolution's backward (32 -> 32 channels, 2 x 8 x 8): without oneDNN bf16 (no
    AVX-512), is grad_input the bf16 col2im of bf16-rounded columns?"""
    gen = torch.Generator().manual_seed(0)
    x, g = (torch.randn(2, 32, 8, 8, generator=gen).bfloat16() for _ in range(2))
    w = (torch.randn(32, 32, 3, 3, generator=gen) * 0.1).bfloat16()

    def grads(dt):
        xx, ww = (t.detach().clone().to(dt).requires_grad_() for t in (x, w))
        F.conv2d(xx, ww, padding=1).backward(g.to(dt))
        return xx.grad, ww.grad
    (gi, gw), (gi32, gw32), (gi64, gw64) = grads(torch.bfloat16), grads(torch.float32), grads(torch.float64)
    cols = torch.einsum("ok,bol->bkl", w.float().reshape(32, -1), g.float().reshape(2, 32, -1)).bfloat16()
    col2im = torch.equal(F.fold(cols, (8, 8), (3, 3), padding=1), gi)
    print(f"  conv2d backward(bf16), oneDNN bf16 {torch.ops.mkldnn._is_mkldnn_bf16_supported()}: grad_input rel-L2 "
          f"{_rel(gi, gi64):.2e} vs {_rel(gi32.bfloat16(), gi64):.2e} for float32 rounded once (bf16 col2im of bf16 "
          f"columns bit for bit: {col2im}), grad_weight {_rel(gw, gw64):.2e} vs {_rel(gw32.bfloat16(), gw64):.2e}")


def main() -> None:
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}")
    layer_norm_backward()
    embedding_backward()
    foreach_mul_scalar_inplace()
    matrix_exp_bf16()
    div_trunc_bf16()
    soft_margin_loss_fp16()
    grid_sample_bf16()
    addbmm_bf16()
    conv_backward_bf16()


if __name__ == "__main__":
    main()
