"""Optimizer states are judged at the dtype they are held in: a vendor AdamW on bf16 parameters
whose float32 first moment is rounded through bf16, or whose weight decay is applied twice, is
named at its first step against a correct float32/float64 reference, while a correct optimizer
against the same reference (with or without a noise run) is not flagged."""
from __future__ import annotations

import json
import math
from typing import List

import pytest
import torch

import precisiondiff
from precisiondiff.watch import compare_logs, read_logs
from precisiondiff.watch.compare import _eps, _quantities

from . import train
from ..bisect.planted_optim import VendorAdamW

LR, DECAY, STEPS = 3e-3, 0.1, 5


class ReferenceAdamW(torch.optim.Optimizer):
    """A correct mixed-precision AdamW: float32 master weights and moments (the vendor's state
    names), the update computed in ``math`` (float64: each state rounded once per step to
    float32), the parameter the master weight rounded to its dtype."""

    def __init__(self, params, lr: float = LR, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = DECAY,
                 math: torch.dtype = torch.float64) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.math = math

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["master"] = p.detach().to(torch.float32, copy=True)
                    state["exp_avg"] = torch.zeros_like(state["master"])
                    state["exp_avg_sq"] = torch.zeros_like(state["master"])
                    state["step"] = torch.zeros((), dtype=torch.float32)
                state["step"].add_(1)
                n = float(state["step"])
                w, m, v = (state[k].to(self.math) for k in ("master", "exp_avg", "exp_avg_sq"))
                g = p.grad.to(self.math)
                w = w * (1 - lr * wd)
                m = beta1 * m + (1 - beta1) * g
                v = beta2 * v + (1 - beta2) * g * g
                w = w - (lr / (1 - beta1 ** n)) * m / ((v / (1 - beta2 ** n)).sqrt() + group["eps"])
                for k, value in (("master", w), ("exp_avg", m), ("exp_avg_sq", v)):
                    state[k].copy_(value)
                p.copy_(state["master"])
        return None


def _run(out, optimizer, bug_from: int = 0, **options) -> None:
    """The 2-block decoder in bf16, trained STEPS steps by ``optimizer(params)`` under watch; a
    VendorAdamW's ``bug`` is on from step ``bug_from``."""
    model, _, tokens = train.build(dtype=torch.bfloat16, layers=2)
    opt = optimizer(model.parameters())
    bug = getattr(opt, "bug", "")
    with precisiondiff.watch(out, model=model, optimizer=opt, **options) as w:
        for step in range(STEPS):
            if isinstance(opt, VendorAdamW):
                opt.bug = bug if step >= bug_from else ""
            w.step(loss=train.train_step(model, opt, tokens))


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    d = tmp_path_factory.mktemp("states")
    every = {"param_every": 1}  # state norms at every step: the strictest check of the clean runs
    _run(d / "ref", lambda ps: ReferenceAdamW(ps), **every)
    _run(d / "noise", lambda ps: ReferenceAdamW(ps, math=torch.float32), **every)  # a second correct implementation
    _run(d / "clean", lambda ps: VendorAdamW(ps, lr=LR, weight_decay=DECAY), **every)
    for bug in ("moment", "decay"):  # at the default --param-every: its first step is a full one
        _run(d / bug, lambda ps, bug=bug: VendorAdamW(ps, lr=LR, weight_decay=DECAY, bug=bug))
    _run(d / "late", lambda ps: VendorAdamW(ps, lr=LR, weight_decay=DECAY, bug="moment"), bug_from=2, **every)
    return d


def test_the_log_records_the_dtype_each_quantity_is_held_in(logs):
    first = read_logs(logs / "moment")[0].steps[0]
    held = first["param_dtypes"]["blocks.0.attn.qkv.weight"]
    assert held == {"grad": "bfloat16", "weight": "bfloat16", "update_ratio": "bfloat16",
                    "state.master": "float32", "state.exp_avg": "float32", "state.exp_avg_sq": "float32"}
    assert "param_dtypes" not in read_logs(logs / "moment")[0].steps[1]  # declared once


@pytest.mark.parametrize("bug, state", [("moment", "state.exp_avg"), ("decay", "state.master")])
def test_a_subtle_optimizer_bug_is_named_at_its_first_step(logs, bug, state):
    first = compare_logs(logs / bug, logs / "ref").first_divergence
    assert first is not None, f"{bug}: no divergence"
    # steps' forward and backward are bitwise equal at step 0: the first quantity to cross is the
    # first parameter's float32 state, judged at float32's eps
    assert (first["step"], first["scope"], first["tensor"]) == (0, "embed.weight", state), first
    assert first["eps"] == torch.finfo(torch.float32).eps
    assert first["error"] > 10 * first["threshold"]
    # ... and so it is with a noise run (a second correct implementation) giving the band
    noisy = compare_logs(logs / bug, logs / "ref", noise=logs / "noise").first_divergence
    assert noisy is not None and (noisy["step"], noisy["tensor"]) == (0, state), noisy


def test_a_bug_that_starts_later_is_named_at_that_step(logs):
    """The moment bug from step 2 on, against the clean vendor run (correct float32 math, bitwise
    equal until then): named at step 2."""
    first = compare_logs(logs / "late", logs / "clean").first_divergence
    assert (first["step"], first["scope"], first["tensor"]) == (2, "embed.weight", "state.exp_avg"), first


def test_a_correct_optimizer_is_not_flagged(logs):
    for noise in (None, logs / "noise"):
        c = compare_logs(logs / "clean", logs / "ref", noise=noise)
        assert c.first_divergence is None, (noise, c.first_divergence)
        assert c.data["steps"] == STEPS and not all(e["bitwise"] for e in c.data["per_step"])  # not a trivial pass
    assert compare_logs(logs / "noise", logs / "ref").first_divergence is None


def test_the_state_is_judged_at_the_inputs_precision_once_its_gradients_differ(logs):
    """A bf16 run against a float64 one: gradients differ from step 0, so the float32 states carry
    bf16 rounding, and their threshold is the parameters' (bf16) one."""
    la, lb = read_logs(logs / "clean")[0], read_logs(logs / "ref")[0]
    quantities = {q.key: q for q in _quantities(la, lb, [0])}
    q = quantities["embed.weight:state.exp_avg"]
    assert q.fine_eps == torch.finfo(torch.float32).eps and q.eps == torch.finfo(torch.bfloat16).eps
    assert quantities["embed.weight:grad"].fine_eps == torch.finfo(torch.bfloat16).eps


def _strip(src, dst) -> None:
    """A copy of a log as written before ``param_dtypes`` existed."""
    dst.mkdir()
    lines: List[str] = []
    for line in (src / "watch.jsonl").read_text().splitlines():
        record = json.loads(line)
        record.pop("param_dtypes", None)
        lines.append(json.dumps(record))
    (dst / "watch.jsonl").write_text("\n".join(lines) + "\n")


def test_old_logs_without_param_dtypes_are_judged_by_the_parameters_dtype(logs, tmp_path):
    _strip(logs / "moment", tmp_path / "a")
    _strip(logs / "ref", tmp_path / "b")
    la, lb = read_logs(tmp_path / "a")[0], read_logs(tmp_path / "b")[0]
    q = {q.key: q for q in _quantities(la, lb, [0])}["embed.weight:state.exp_avg"]
    assert q.fine is None and q.eps == _eps("bfloat16")
    c = compare_logs(tmp_path / "a", tmp_path / "b")  # reads and compares as before
    assert c.data["steps"] == STEPS and all(math.isfinite(e["max_error"]) for e in c.data["per_step"])
    # one new log and one old: the old side has no dtype, so the old rule holds
    mixed = {q.key: q for q in _quantities(read_logs(logs / "moment")[0], lb, [0])}["embed.weight:state.exp_avg"]
    assert mixed.fine is None
