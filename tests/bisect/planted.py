"""Planted-bug models for the bisect tests (dims <= 64, built on the CPU in float32)."""
from __future__ import annotations

import torch
from torch import nn

from precisiondiff import Workload


# -- (2) a fused softmax whose bf16 path accumulates the denominator in bf16 -------------------
@torch.library.custom_op("pdtest::fused_softmax", mutates_args=())
def fused_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    if x.dtype == torch.bfloat16:
        e = torch.exp(x.float() - x.float().amax(dim, keepdim=True)).to(x.dtype)
        acc = torch.zeros_like(e.select(dim, 0))
        for i in range(e.shape[dim]):
            acc = acc + e.select(dim, i)
        return (e / acc.unsqueeze(dim)).to(x.dtype)
    return torch.softmax(x, dim)


@fused_softmax.register_fake
def _(x, dim):
    return torch.empty_like(x)


class SoftmaxAttn(nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(-2, -1) / 8.0
        return self.out(fused_softmax(s, -1) @ x)


def softmax_workload() -> Workload:
    model = nn.Sequential(nn.Linear(64, 64), SoftmaxAttn(64), nn.Linear(64, 16))
    return Workload(model, torch.randn(2, 64, 64))


# -- (3) a custom autograd.Function whose backward is wrong only in bf16 ----------------------
class _ScaleFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        gx = grad * w
        if grad.dtype == torch.bfloat16:
            gx = gx * 1.25  # the bug: a stale scale factor on the low-precision path
        return gx, (grad * x).sum(0)


class Scale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x):
        return _ScaleFn.apply(x, self.weight)


class ScaleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 32)
        self.scale = Scale(32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(self.scale(torch.tanh(self.fc1(x))))


def bad_backward_workload() -> Workload:
    return Workload(ScaleNet(), torch.randn(16, 32), loss=lambda y: y.float().pow(2).mean())


# -- (4) an early kernel error that a later, correct op amplifies ------------------------------
@torch.library.custom_op("pdtest::sloppy_scale", mutates_args=())
def sloppy_scale(x: torch.Tensor, s: float) -> torch.Tensor:
    if x.dtype == torch.bfloat16:
        return (x.float() * s * (1 + 2 ** -5)).to(x.dtype)  # a few ulps off
    return x * s


@sloppy_scale.register_fake
def _(x, s):
    return torch.empty_like(x)


class Amplify(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        a = self.fc(x)
        b = sloppy_scale(a, 1.0)
        c = (b - a) + 0.01 * a  # cancellation: b - a should be exactly 0
        return self.head(c)


def amplify_workload() -> Workload:
    return Workload(Amplify(), torch.randn(8, 32))


# -- (5) controls ---------------------------------------------------------------------------
def mlp_workload() -> Workload:
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 8))
    return Workload(model, torch.randn(16, 32), loss=lambda y: y.float().pow(2).mean())


class Cancel(nn.Module):
    """a(x) - b(x) with b's weights within 1e-3 of a's: catastrophic cancellation."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)
        with torch.no_grad():
            self.b.weight.copy_(self.a.weight + 1e-3 * torch.randn_like(self.a.weight))
            self.b.bias.copy_(self.a.bias)

    def forward(self, x):
        return self.a(x) - self.b(x)


def ill_conditioned_workload() -> Workload:
    model = nn.Sequential(nn.Linear(16, 32), Cancel())
    return Workload(model, torch.randn(16, 16), loss=lambda y: y.float().pow(2).mean())


# -- (6) a vendor op with no float64 implementation ------------------------------------------
@torch.library.custom_op("pdtest::vendor_rms_norm", mutates_args=())
def vendor_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float64:
        raise RuntimeError("vendor_rms_norm: float64 is not supported by this kernel")
    if x.dtype == torch.bfloat16:
        acc = torch.zeros(x.shape[:-1], dtype=x.dtype)
        for i in range(x.shape[-1]):
            acc = acc + x[..., i] * x[..., i]
        return x * torch.rsqrt(acc / x.shape[-1] + 1e-6).unsqueeze(-1) * weight
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


@vendor_rms_norm.register_fake
def _(x, weight):
    return torch.empty_like(x)


def vendor_reference(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


class VendorNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return vendor_rms_norm(x, self.weight)


def vendor_workload() -> Workload:
    model = nn.Sequential(nn.Linear(64, 64), VendorNorm(64), nn.Linear(64, 16))
    return Workload(model, 3.0 + torch.randn(32, 64))


# -- (7) a nondeterministic kernel: bf16 output with run-to-run noise (atomics-like) ----------
_NOISE_GEN = torch.Generator()
_NOISE_GEN.seed()  # unseeded: a fresh draw every call, whatever torch.manual_seed says


@torch.library.custom_op("pdtest::noisy_reduce", mutates_args=())
def noisy_reduce(x: torch.Tensor) -> torch.Tensor:
    """``x`` unchanged up to rounding, plus (bf16 only) noise of ~2 ULP that differs every run,
    as a reduction whose order depends on thread scheduling would give."""
    if x.dtype == torch.bfloat16:
        noise = torch.randn(x.shape, generator=_NOISE_GEN, dtype=torch.float32) * 2 ** -7
        return (x.float() + noise * x.float().abs()).to(x.dtype)
    return x.clone()


@noisy_reduce.register_fake
def _(x):
    return torch.empty_like(x)


class NoisyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(noisy_reduce(torch.tanh(self.fc1(x))))


def noisy_workload() -> Workload:
    return Workload(NoisyNet(), torch.randn(16, 32))


# -- (8) a zoo model with one layer's RMSNorm replaced by a fused kernel with a bf16 accumulator --
@torch.library.custom_op("pdtest::zoo_rms_norm", mutates_args=())
def zoo_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm as one kernel; in bf16 the sum of squares runs in a bf16 accumulator."""
    if x.dtype == torch.bfloat16:
        acc = torch.zeros(x.shape[:-1], dtype=x.dtype)
        for i in range(x.shape[-1]):
            acc = acc + x[..., i] * x[..., i]
        variance = (acc / x.shape[-1]).float()
        return (weight.float() * (x.float() * torch.rsqrt(variance + eps).unsqueeze(-1))).to(x.dtype)
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


@zoo_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


def _zoo_rms_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    xf, gf, wf = x.double(), grad.double(), weight.double()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)
    normed = xf * rstd
    grad_weight = (gf * normed).reshape(-1, x.shape[-1]).sum(0)
    gn = gf * wf
    grad_x = rstd * (gn - normed * (gn * normed).mean(-1, keepdim=True))
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


def _zoo_rms_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


zoo_rms_norm.register_autograd(_zoo_rms_backward, setup_context=_zoo_rms_setup)


class FusedRMSNorm(nn.Module):
    """Drop-in for LlamaRMSNorm that calls the fused kernel above."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.variance_epsilon

    def forward(self, x):
        return zoo_rms_norm(x, self.weight, self.eps)


def llama_with_planted_norm() -> Workload:
    """The zoo's Llama with ``model.layers.1.post_attention_layernorm`` replaced by the fused kernel."""
    from tests.zoo import ZOO
    workload = ZOO["llama"]()
    layer = workload.model.model.layers[1]
    layer.post_attention_layernorm = FusedRMSNorm(layer.post_attention_layernorm)
    return workload


# -- (9) a ResNet whose convolutions are kernels we plant: fp32-accumulating, or bf16 ---------------
@torch.library.custom_op("pdtest::conv3x3", mutates_args=())
def conv3x3(x: torch.Tensor, weight: torch.Tensor, bf16_accumulator: bool) -> torch.Tensor:
    """A 3x3 same-padding convolution: products summed in float32 (or, planted, in a bf16
    accumulator for bf16 inputs), one rounding to the input dtype."""
    cols = torch.nn.functional.unfold(x.float() if x.dtype != torch.float64 else x, 3, padding=1)
    w = weight.reshape(weight.shape[0], -1).to(cols.dtype)
    if bf16_accumulator and x.dtype == torch.bfloat16:
        acc = torch.zeros(x.shape[0], weight.shape[0], cols.shape[-1], dtype=torch.bfloat16)
        for j in range(w.shape[1]):
            acc = acc + (w[:, j, None] * cols[:, None, j, :]).to(torch.bfloat16)
        out = acc
    else:
        out = w @ cols
    return out.reshape(x.shape[0], weight.shape[0], x.shape[2], x.shape[3]).to(x.dtype)


@conv3x3.register_fake
def _(x, weight, bf16_accumulator):
    return x.new_empty(x.shape[0], weight.shape[0], x.shape[2], x.shape[3])


def _conv3x3_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    gx, gw = torch.ops.aten.convolution_backward(
        grad.double(), x.double(), weight.double(), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
        [True, True, False])[:2]
    return gx.to(x.dtype), gw.to(weight.dtype), None


def _conv3x3_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight)


conv3x3.register_autograd(_conv3x3_backward, setup_context=_conv3x3_setup)


class PlantedConv(nn.Module):
    def __init__(self, c: int, bf16_accumulator: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(c, c, 3, 3) / (3 * c ** 0.5))
        self.bf16_accumulator = bf16_accumulator

    def forward(self, x):
        return conv3x3(x, self.weight, self.bf16_accumulator)


class InPlaceBlock(nn.Module):
    """torchvision's BasicBlock idioms: ReLU(inplace=True) after BatchNorm, ``out += x``."""

    def __init__(self, c: int, bf16_accumulator: bool):
        super().__init__()
        self.conv1, self.bn1 = PlantedConv(c, False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = PlantedConv(c, bf16_accumulator), nn.BatchNorm2d(c)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


def inplace_resnet_workload(bf16_accumulator: bool) -> Workload:
    model = nn.Sequential(InPlaceBlock(8, False), InPlaceBlock(8, bf16_accumulator),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    x, y = torch.randn(2, 8, 8, 8), torch.randint(0, 10, (2,))
    return Workload(model, x, loss=lambda o: nn.functional.cross_entropy(o.float() if o.dtype != torch.float64 else o, y))
