"""Replays on many workers (bisect/workers.py): ``--workers N`` (a process pool on this host) and
``torchrun ... bisect DUMP`` judge the op and module replays of the descent on several processes and give the
result of one worker, figure for figure; a multi-rank dump is shared out by rank. 2 workers, gloo
on 127.0.0.1."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from precisiondiff.bisect import bisect_dump
from precisiondiff.bisect.ranks import bisect_ranks
from precisiondiff.capture.runner import capture_workload
from tests.conftest import ROOT, pd_cli

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")

PLANTED = "tests/bisect/planted_blocks.py:planted_workload"
CLEAN = "tests/bisect/planted_blocks.py:clean_workload"
TIMINGS = ("wall_s", "search_s", "workers")  # what may differ between runs


def _figures(result: dict) -> dict:
    """The result without wall-clock times and the workers' description."""
    out = dict(result)
    out["cost"] = {k: v for k, v in result["cost"].items() if k not in TIMINGS}
    return out


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    path = tmp_path_factory.mktemp("workers") / "dut"
    capture_workload(PLANTED, path, target="cpu/bf16", mode="replay")
    return str(path)


@pytest.fixture(scope="module")
def one_worker(dump):
    return bisect_dump(dump, workload=PLANTED).to_json()


def _torchrun(*args: str, port: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(port), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "PYTHONPATH": ROOT})


def test_two_local_workers_give_the_result_of_one(dump, one_worker):
    two = bisect_dump(dump, workload=PLANTED, workers=2, modules_on_workers=True)
    assert one_worker["verdict"] == "kernel"
    assert one_worker["culprit"]["name"] == "pdblocks.acc_linear.default"
    assert two.cost["workers"]["n"] == 2 and "workers" not in one_worker["cost"]
    assert two.cost["workers"]["module_units"] > 0  # the module phase went to the workers too
    ops_only = bisect_dump(dump, workload=PLANTED, workers=2)  # the default: local workers judge ops only
    assert ops_only.cost["workers"]["module_units"] == 0
    # the search's process waits on the workers for part of the replay phase, never longer than the phase
    assert 0 < ops_only.cost["workers"]["waited_s"] <= ops_only.cost["search_s"]
    assert json.dumps(_figures(ops_only.to_json()), sort_keys=True) == json.dumps(_figures(one_worker), sort_keys=True)
    assert json.dumps(_figures(two.to_json()), sort_keys=True) == json.dumps(_figures(one_worker), sort_keys=True)


@pytest.fixture(scope="module")
def clean_dump(tmp_path_factory):
    path = tmp_path_factory.mktemp("workers") / "clean"
    capture_workload(CLEAN, path, target="cpu/bf16", mode="replay")
    return str(path)


@pytest.mark.parametrize("planted", [False, True], ids=["clean", "planted"])
def test_the_block_wise_module_phase_on_two_workers_gives_the_result_of_one(planted, dump, clean_dump):
    """Block-wise (the root over the replay limit), every block the descent judges goes to the
    workers (``modules_on_workers``; a torchrun job's processes always share them), with the same
    figures as when the search's process judges it."""
    from precisiondiff.bisect.engine import replay_bytes
    from tests.bisect import planted_blocks
    limit = max(replay_bytes(m, torch.float64) for m in planted_blocks.clean_workload().model.children())
    path, workload = (dump, PLANTED) if planted else (clean_dump, CLEAN)
    one = bisect_dump(path, workload=workload, max_replay_bytes=limit).to_json()
    two = bisect_dump(path, workload=workload, max_replay_bytes=limit, workers=2, modules_on_workers=True)
    if planted:  # the root holds the planted op: never judged
        assert one["verdict"] == "kernel"
    else:
        assert one["verdict"] in ("parity", "accumulated") and one["cost"]["block_wise"]["not_replayed_whole"]
    assert two.cost["workers"]["module_units"] > 0
    # the workers' templates were built on the meta device: no model built, no random init
    assert two.cost["workers"]["templates"] == {"meta": two.cost["workers"]["module_units"]}
    assert json.dumps(_figures(two.to_json()), sort_keys=True) == json.dumps(_figures(one), sort_keys=True)


def test_a_worker_replays_with_the_real_model_where_the_dump_cannot_restore_a_meta_template(tmp_path):
    """A module holding a tensor as a plain attribute (no ``param.*`` slot restores it): the
    worker's meta template is refused and the worker builds the workload's model, with the
    figures of one process."""
    from precisiondiff.bisect.engine import replay_bytes
    from tests.bisect import planted_blocks
    gain = "tests/bisect/planted_blocks.py:gain_workload"
    path = tmp_path / "gain"
    capture_workload(gain, path, target="cpu/bf16", mode="replay")
    limit = max(replay_bytes(m, torch.float64) for m in planted_blocks.gain_workload().model.children())
    one = bisect_dump(path, workload=gain, max_replay_bytes=limit).to_json()
    two = bisect_dump(path, workload=gain, max_replay_bytes=limit, workers=2, modules_on_workers=True)
    assert one["verdict"] == "kernel"
    assert two.cost["workers"]["templates"].get("built", 0) > 0
    assert json.dumps(_figures(two.to_json()), sort_keys=True) == json.dumps(_figures(one), sort_keys=True)


@pytest.mark.parametrize("case", ["planted", "gain"])
def test_the_search_replays_meta_templates_and_builds_the_model_only_when_needed(case, dump, tmp_path, monkeypatch):
    """The search's own process replays modules from templates built on the meta device (no random
    initialisation of the model); it builds the real model only where a template's state is not in
    the dump (the gain block's plain tensor attribute) or for the reference run: block-wise with a
    culprit (no reference run), the planted stack is never built for real. Either way the figures
    are those of replaying the real model throughout."""
    from precisiondiff.bisect import offline
    from precisiondiff.bisect.engine import replay_bytes
    from tests.bisect import planted_blocks
    workload, path = PLANTED, dump
    if case == "gain":
        workload, path = "tests/bisect/planted_blocks.py:gain_workload", str(tmp_path / "gain")
        capture_workload(workload, path, target="cpu/bf16", mode="replay")
    limit = max(replay_bytes(m, torch.float64) for m in planted_blocks.clean_workload().model.children())
    real_builds = []
    build = offline._workload_for

    def counting(*args, on_meta=False, **kwargs):
        real_builds.extend([] if on_meta else [1])
        return build(*args, on_meta=on_meta, **kwargs)
    monkeypatch.setattr(offline, "_workload_for", counting)
    lazy = bisect_dump(path, workload=workload, max_replay_bytes=limit).to_json()
    assert lazy["verdict"] == "kernel"
    assert len(real_builds) == (1 if case == "gain" else 0)

    class Real(offline.Templates):  # the real model from the start, as before
        def __init__(self, *args):
            super().__init__(*args)
            self.real()
    monkeypatch.setattr(offline, "Templates", Real)
    eager = bisect_dump(path, workload=workload, max_replay_bytes=limit).to_json()
    assert json.dumps(_figures(lazy), sort_keys=True) == json.dumps(_figures(eager), sort_keys=True)


def test_a_meta_template_takes_all_its_state_from_the_recorded_call():
    from precisiondiff.bisect.isolate import IncompleteTemplate, UnitEvent, _module_copy
    with torch.device("meta"):
        template = torch.nn.Linear(3, 2)
    weight, bias = torch.randn(2, 3, dtype=torch.bfloat16), torch.randn(2, dtype=torch.bfloat16)
    values = {"param.weight": weight, "param.bias": bias}

    def event(slots):
        return UnitEvent(0, "module", "lin", "Linear", "forward", 0, {s: ("bfloat16", (), True) for s in slots},
                         None, load=values.__getitem__)
    module = _module_copy(template, event(values), "cpu", torch.float64)
    assert module.weight.dtype == torch.float64 and not module.weight.is_meta
    assert torch.equal(module.weight, weight.double()) and torch.equal(module.bias, bias.double())
    with pytest.raises(IncompleteTemplate, match="bias"):
        _module_copy(template, event(["param.weight"]), "cpu", torch.float64)
    template.scale = torch.ones(2, device="meta")
    with pytest.raises(IncompleteTemplate, match="scale"):
        _module_copy(template, event(values), "cpu", torch.float64)


def test_torchrun_processes_share_the_replays_and_process_0_reports_the_result_of_one(dump, one_worker, tmp_path):
    from tests.distributed.conftest import free_port
    out = tmp_path / "bisect.json"
    run = _torchrun("-m", "precisiondiff.cli", "bisect", dump, "--workload", PLANTED, "--format", "json",
                    "-o", str(out), port=free_port())
    assert run.returncode == 1, run.stderr[-2000:]  # the verdict's code: a culprit
    got = json.loads(out.read_text())
    assert {k: v for k, v in got["cost"]["workers"].items() if k != "module_units"} == {"n": 2, "kind": "DistPool"}
    assert got["cost"]["workers"]["module_units"] > 0
    assert json.dumps(_figures(got), sort_keys=True) == json.dumps(_figures(one_worker), sort_keys=True)


def test_a_multi_rank_dump_is_bisected_rank_by_rank_on_workers(tmp_path):
    from tests.distributed.conftest import free_port
    run_dir = tmp_path / "job"
    cap = _torchrun("-m", "precisiondiff.cli", "capture", PLANTED, "--target", "cpu/bf16", "--mode", "replay",
                    "-o", str(run_dir), port=free_port())
    assert cap.returncode == 0, cap.stderr[-2000:]
    assert sorted(p.name for p in run_dir.iterdir()) == ["rank0", "rank1"]
    one = bisect_ranks(run_dir, workload=PLANTED).to_json()
    two = bisect_ranks(run_dir, workload=PLANTED, workers=2).to_json()
    assert one["verdict"] == "kernel" and one["culprit"]["name"] == "pdblocks.acc_linear.default"
    assert sorted(one["ranks"]) == ["0", "1"]
    assert json.dumps(_figures(two), sort_keys=True) == json.dumps(_figures(one), sort_keys=True)


def test_workers_on_a_live_workload_is_one_clear_line():
    bad = pd_cli("bisect", PLANTED, "--workers", "2")
    assert bad.returncode == 2 and "--workers applies to a DUT_DUMP" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_modules_on_workers_from_the_command_line(dump, one_worker, tmp_path):
    out = tmp_path / "two.json"
    run = pd_cli("bisect", dump, "--workload", PLANTED, "--workers", "2", "--modules-on-workers",
                 "--format", "json", "-o", str(out))
    assert run.returncode == 1, run.stderr[-2000:]  # the verdict's code: a culprit
    got = json.loads(out.read_text())
    assert got["cost"]["workers"]["module_units"] > 0
    assert set(got["cost"]["workers"]["templates"]) == {"meta"}
    assert json.dumps(_figures(got), sort_keys=True) == json.dumps(_figures(one_worker), sort_keys=True)
    alone = pd_cli("bisect", dump, "--workload", PLANTED, "--modules-on-workers")
    assert alone.returncode == 2 and "--modules-on-workers applies with --workers" in alone.stderr
    assert len(alone.stderr.strip().splitlines()) == 1


def test_the_peer_rule_gives_the_same_figures_whatever_the_thread_count():
    """A local worker runs fewer threads than the search's process (the cores shared out); the
    figures of an op judged there must be those of the search's own judgement, bit for bit. Above
    torch's grain size (32768 elements) its sums are split among the threads."""
    from precisiondiff.comparators.peers import judge_against_peers
    gen = torch.Generator().manual_seed(3)
    n = 200_000
    golden = torch.randn(n, dtype=torch.float64, generator=gen)
    dut = (golden * (1 + torch.rand(n, dtype=torch.float64, generator=gen) * 2 ** -7)).to(torch.bfloat16)
    before = torch.get_num_threads()
    seen = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            v = judge_against_peers(dut, golden, {"float32": golden.to(torch.bfloat16)},
                                    magnitude=golden.abs() + 1, k=64)
            seen.append(json.dumps(v.as_dict(), sort_keys=True))
    finally:
        torch.set_num_threads(before)
    assert "rmse_z" in seen[0]  # the paired RMSE test ran: its mean and sd are long sums
    assert seen[0] == seen[1] == seen[2]


def test_a_bisect_judging_its_outputs_a_block_at_a_time_gives_the_result_of_one_pass(dump, one_worker,
                                                                                     monkeypatch):
    """With blocks of 100 elements every output of the planted model is judged a block at a time:
    the bisect's result (verdicts, culprit, every figure) is the one-pass result."""
    from precisiondiff.comparators import peers
    monkeypatch.setattr(peers, "JUDGE_BLOCK_ELEMENTS", 100)
    blocked = bisect_dump(dump, workload=PLANTED).to_json()
    assert blocked["culprit"]["name"] == "pdblocks.acc_linear.default"
    assert _figures(blocked) == _figures(one_worker)


def test_the_compare_kernels_are_compiled_before_local_workers_start():
    """Two workers meeting a cold numba cache would fill it at once (numba#4807): the pool's
    parent compiles (or loads) both of the tile's specializations first."""
    pytest.importorskip("numba")
    from precisiondiff.bisect.workers import warm_kernels
    from precisiondiff.comparators import tiles_kernel
    if not tiles_kernel.AVAILABLE:
        pytest.skip("numba disabled")
    warm_kernels()
    assert len(tiles_kernel._kernels()._tiles.signatures) >= 2  # bf16 and float32 actuals
