"""Planted optimizers for the optimizer tests: a vendor fused AdamW as a ``torch.library`` custom
op with its own float32 master weights, clean or with one bug on its low-precision path, and
training workloads around it and around stock AdamW/SGD (dims <= 64, built on the CPU in float32).

The vendor op updates, per parameter, the float32 master weight, the float32 moments and the
step, then writes the master weight rounded to the parameter's dtype into the parameter. When
the parameter is bf16/fp16 (the mixed-precision path a vendor writes by hand) it can be wrong:

* ``moment``: the first moment is rounded through bf16 before it is stored;
* ``bias``: the bias correction is dropped;
* ``decay``: the weight decay is applied twice;
* ``late``: as ``moment``, from the second step on (the first step is right).

On float32 or float64 parameters (the peer's and the golden's replays) it is always correct.
"""
from __future__ import annotations

from typing import List

import torch
from torch import nn

from precisiondiff import Workload

BUGS = ("", "moment", "bias", "decay", "late")


@torch.library.custom_op("pdtest::vendor_adamw_", mutates_args=("params", "masters", "exp_avgs", "exp_avg_sqs", "steps"))
def vendor_adamw_(params: List[torch.Tensor], masters: List[torch.Tensor], grads: List[torch.Tensor],
                  exp_avgs: List[torch.Tensor], exp_avg_sqs: List[torch.Tensor], steps: List[torch.Tensor],
                  lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, bug: str) -> None:
    for p, w, g, m, v, s in zip(params, masters, grads, exp_avgs, exp_avg_sqs, steps):
        low = p.dtype in (torch.bfloat16, torch.float16)
        s.add_(1)
        step = float(s)
        gw = g.to(w.dtype)
        w.mul_(1 - lr * weight_decay)
        if low and bug == "decay":
            w.mul_(1 - lr * weight_decay)
        m.lerp_(gw, 1 - beta1)
        if low and (bug == "moment" or (bug == "late" and step >= 2)):
            m.copy_(m.to(torch.bfloat16))
        v.mul_(beta2).addcmul_(gw, gw, value=1 - beta2)
        bc1, bc2 = (1.0, 1.0) if low and bug == "bias" else (1 - beta1 ** step, 1 - beta2 ** step)
        w.addcdiv_(m, (v / bc2).sqrt() + eps, value=-lr / bc1)
        p.copy_(w)


@vendor_adamw_.register_fake
def _(params, masters, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay, bug):
    return None


class VendorAdamW(torch.optim.Optimizer):
    """AdamW with float32 master weights and moments, one fused call per step."""

    def __init__(self, params, lr: float = 1e-2, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.1, bug: str = "") -> None:
        assert bug in BUGS
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.bug = bug

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lists: List[List[torch.Tensor]] = [[], [], [], [], [], []]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["master"] = p.detach().to(torch.float32, copy=True)
                    state["exp_avg"] = torch.zeros_like(state["master"])
                    state["exp_avg_sq"] = torch.zeros_like(state["master"])
                    state["step"] = torch.zeros((), dtype=torch.float32)
                for lst, t in zip(lists, (p, state["master"], p.grad, state["exp_avg"], state["exp_avg_sq"],
                                          state["step"])):
                    lst.append(t)
            if lists[0]:
                beta1, beta2 = group["betas"]
                torch.ops.pdtest.vendor_adamw_(*lists, group["lr"], beta1, beta2, group["eps"],
                                               group["weight_decay"], self.bug)
        return None


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 8)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _workload(optimizer, steps: int = 2) -> Workload:
    return Workload(Mlp(), torch.randn(16, 32), loss=lambda y: y.pow(2).mean(), optimizer=optimizer, steps=steps)


def vendor(bug: str = "", steps: int = 2) -> Workload:
    """The MLP trained ``steps`` steps by :class:`VendorAdamW` with ``bug``."""
    return _workload(lambda ps: VendorAdamW(ps, bug=bug), steps)


def vendor_moment() -> Workload:
    return vendor("moment")


def vendor_clean() -> Workload:
    return vendor("")


def stock_adamw_fused() -> Workload:
    return _workload(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True))


def stock_adamw_foreach() -> Workload:
    return _workload(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True))


def stock_sgd_foreach() -> Workload:
    return _workload(lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=1e-3, foreach=True))


def vendor_bias() -> Workload:
    return vendor("bias")


def vendor_decay() -> Workload:
    return vendor("decay")


def scaled_adamw() -> Workload:
    """Foreach AdamW through a GradScaler, with a StepLR schedule (float32 parameters: autocast targets)."""
    wl = _workload(lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True))
    wl.scaler = lambda: torch.amp.GradScaler("cpu", init_scale=256.0)
    wl.scheduler = lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    return wl


def vendor_late() -> Workload:
    return vendor("late")
