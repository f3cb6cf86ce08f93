"""DeepSpeed as a user runs it: ``deepspeed.initialize`` on a tiny random GPT-2 of transformers'
own code, ZeRO 1, 2 and 3, bf16, ``engine.backward`` / ``engine.step``, under ``precisiondiff
capture --script``, ``bisect --script``, ``watch --script``, the Python API, and ``torchrun`` with 2 gloo ranks
(examples/frameworks/deepspeed_gpt2.py, unmodified framework code; DS_ACCELERATOR=cpu). Skipped
without deepspeed. The first DeepSpeed start on a machine compiles its shared-memory comm op
(minutes); later starts reuse it. Each DeepSpeed start costs ~15 s of CPU: the runs are
module-scoped fixtures, each shared by the tests that read it.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before deepspeed is imported: it picks its accelerator then
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

import precisiondiff  # noqa: E402
from tests.conftest import pd_cli  # noqa: E402
from tests.distributed.conftest import free_port as _free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "examples" / "frameworks" / "deepspeed_gpt2.py")
ENV = {"OMP_NUM_THREADS": "1"}
PLANT = "pdframeworks.rough_gelu.default"
PARAMS = 28  # the tiny GPT-2's parameters (the tied lm_head/wte weight once)
LAYER_NORM_BACKWARD = "aten.native_layer_norm_backward"


def _run(*args: str):
    return pd_cli(*args, env={**ENV, "MASTER_PORT": str(_free_port())})  # the example's default port may be taken


def _losses(stdout: str) -> list:
    return re.findall(r"^step \d+ loss (\S+)$", stdout, flags=re.M)


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 -m precisiondiff ARGS`` on 127.0.0.1 (gloo)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "precisiondiff", *args]
    env = {**os.environ, **ENV, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=str(ROOT))


def _report(path: Path, r) -> dict:
    assert path.exists(), (r.returncode, r.stderr[-3000:])
    return json.loads(path.read_text())


def _only_known_after(report: dict, first: int = 0) -> list:
    """The culprits after the ``first`` that are not documented stock findings (``known``)."""
    return [(c["name"], c["scope"]) for c in report["culprits"][first:] if not c.get("known")]


# -- one process: capture ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same model and step without DeepSpeed, captured in float64 (one process)."""
    out = tmp_path_factory.mktemp("ds") / "ref"
    r = _run("capture", f"{SCRIPT}:build", "--target", "cpu/float64", "-o", str(out), "--mode", "stats")
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def zero2_module(tmp_path_factory):
    """ZeRO-2 bf16, module level, stats mode, the first of 2 steps (the reference has one); and
    the losses the script printed."""
    out = tmp_path_factory.mktemp("ds") / "z2"
    r = _run("capture", "--script", SCRIPT, "-o", str(out), "--level", "module", "--mode", "stats",
             "--steps", "0", "--", "--zero", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    return out, _losses(r.stdout)


@pytest.fixture(scope="module")
def plain_losses():
    """The losses of 2 plain ZeRO-2 bf16 steps, printed by the example run without precisiondiff."""
    plain = subprocess.run([sys.executable, SCRIPT, "--zero", "2"], capture_output=True, text=True,
                           env={**os.environ, **ENV, "MASTER_PORT": str(_free_port())}, timeout=600)
    assert plain.returncode == 0, plain.stderr[-3000:]
    return _losses(plain.stdout)


def test_module_capture_under_zero2_records_every_block_and_keeps_the_losses(zero2_module, plain_losses):
    out, captured = zero2_module
    assert captured == plain_losses and len(captured) == 2
    dump = precisiondiff.load(out)
    scopes = {ev.scope for ev in dump.events() if ev.kind == "module"}
    for block in ("transformer.h.0", "transformer.h.1.mlp", "lm_head"):
        assert any(s.endswith(block) for s in scopes), (block, sorted(scopes)[:20])
    assert {ev.direction for ev in dump.events() if ev.kind == "module"} == {"forward", "backward"}


def test_zero2_parameter_gradients_are_recorded_and_agree_with_float64(zero2_module, reference):
    """ZeRO keeps gradients out of p.grad: capture reads them from the engine's partition
    (precisiondiff/capture/deepspeed.py), reduced and before DeepSpeed's clipping (1.0 by default,
    which here scales every gradient by ~0.45: a clipped gradient fails every row)."""
    out, _ = zero2_module
    dump = precisiondiff.load(out)
    grads = {(ev.scope, r.slot): r for ev in dump.events() if ev.kind == "param" for r in ev.tensors}
    ref_grads = [r for ev in precisiondiff.load(reference).events() if ev.kind == "param" for r in ev.tensors]
    assert len(grads) == len(ref_grads) > 20, sorted(grads)[:5]
    assert ("module.transformer.h.1.mlp.c_fc", "param_grad.weight") in grads
    assert {r.dtype for r in grads.values()} <= {"bfloat16", "float32"}  # the engine's accumulation dtype
    assert "ZeRO" in dump.meta["param_grads_from"]
    result = precisiondiff.compare(str(out), str(reference), kind="param")
    rows = [row for row in result.rows if row.match != "none"]
    assert len(rows) == len(ref_grads) and all(row.verdict == "pass" for row in rows), result.summary


# -- one process: bisect --script, clean and planted -----------------------------------------------
@pytest.fixture(scope="module")
def clean_zero1(tmp_path_factory):
    """``bisect --script --keep`` of the clean ZeRO-1 bf16 job: its report and the replay dump."""
    where = tmp_path_factory.mktemp("ds")
    report = where / "bisect.json"
    r = _run("bisect", "--script", SCRIPT, "--keep", str(where / "keep"), "--format", "json", "-o", str(report),
             "--", "--zero", "1")
    return r.returncode, _report(report, r), where / "keep"


def test_bisect_of_a_clean_zero1_job_gets_no_kernel_verdict(clean_zero1):
    """Parity or accumulated, exit 0 for parity: a documented stock finding met on the way (today the
    CPU bf16 layer-norm backward's bf16 partial sums: docs/bisect.md) is passed over and listed in
    ``accepted`` with its measurement, not made the culprit."""
    code, report, _ = clean_zero1
    assert report["verdict"] in ("parity", "accumulated") and report["culprits"] == [], report["culprits"]
    assert code == (0 if report["verdict"] == "parity" else 1)
    assert all(a.get("known") for a in report["accepted"]), report["accepted"]


def test_blame_known_makes_the_documented_findings_of_a_clean_zero1_job_offend_again(clean_zero1, tmp_path):
    """``--blame-known`` judges them as any other op: every offender is then a documented finding."""
    _, first, keep = clean_zero1
    report = tmp_path / "strict.json"
    r = _run("bisect", str(keep), "--format", "json", "-o", str(report), "--blame-known")
    again = _report(report, r)
    if not first["accepted"]:
        assert again["verdict"] in ("parity", "accumulated"), again["culprits"]
        return
    assert r.returncode == 1 and again["verdict"] == "kernel" and again["accepted"] == [], again
    assert again["culprit"].get("known") and _only_known_after(again) == [], again["culprits"]


def test_the_kept_replay_dump_verifies_and_aligns_op_by_op_with_the_workload_reference(clean_zero1, reference):
    _, _, keep = clean_zero1
    assert pd_cli("verify", str(keep)).returncode == 0
    events = list(precisiondiff.load(keep).events())
    mlp = [ev for ev in events if ev.kind == "op" and ev.scope.endswith("transformer.h.1.mlp.c_fc")]
    assert any(ev.name == "aten.addmm.default" and ev.direction == "forward" for ev in mlp), mlp[:5]
    # the script's own ops (model init, DeepSpeed's broadcasts and gradient checks) are left out
    result = precisiondiff.compare(str(keep), str(reference))
    assert any("(a script)" in n for n in result.notes), result.notes
    ops = [row for row in result.rows if row.match != "none" and row.kind == "op"]
    assert len(ops) > 100 and result.summary["unmatched_b"] == 0, result.summary


def test_bisect_script_names_the_planted_gelu_in_block_1(tmp_path):
    report = tmp_path / "bisect.json"
    r = _run("bisect", "--script", SCRIPT, "--format", "json", "-o", str(report), "--", "--zero", "1", "--plant")
    out = _report(report, r)
    c = out["culprit"]
    assert r.returncode == 1 and (c["kind"], c["name"], c["direction"]) == ("op", PLANT, "forward"), c
    assert c["scope"].endswith("transformer.h.1.mlp.act") and not c.get("known"), c
    assert _only_known_after(out, 1) == [], out["culprits"]  # anything after the plant is a known finding


# -- one process: the Python API -------------------------------------------------------------------
@pytest.fixture(scope="module")
def api_planted(tmp_path_factory):
    """One planted ZeRO-1 bf16 step captured with the Python API after deepspeed.initialize."""
    out = tmp_path_factory.mktemp("ds") / "api"
    r = subprocess.run([sys.executable, SCRIPT, "--zero", "1", "--plant", "--steps", "1", "--capture", str(out)],
                       capture_output=True, text=True, env={**os.environ, **ENV, "MASTER_PORT": str(_free_port())},
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _bisect_dump(tmp_path, dump, *args: str) -> tuple:
    report = tmp_path / "bisect.json"
    r = _run("bisect", str(dump), "--format", "json", "-o", str(report), *args)
    return r.returncode, _report(report, r)


def test_bisect_of_an_api_capture_with_the_bare_model_as_workload_names_the_plant(api_planted, tmp_path):
    """The dump's paths (``module.transformer...``) are resolved under the engine's ``module.`` prefix."""
    code, report = _bisect_dump(tmp_path, api_planted, "--workload", f"{SCRIPT}:build_planted")
    c = report["culprit"]
    assert code == 1 and (c["kind"], c["name"], c["scope"], c["direction"]) == \
        ("op", PLANT, "module.transformer.h.1.mlp.act", "forward"), c
    assert _only_known_after(report, 1) == [], report["culprits"]
    assert any("wrapper prefix 'module.'" in n for n in report["notes"]), report["notes"]


def test_bisect_of_an_api_capture_without_workload_says_the_plant_could_not_be_judged(api_planted, tmp_path):
    """Without --workload the custom op is not registered in the bisect's process, so it cannot
    be replayed: the report lists it as unreplayable and warns that the culprit may not be first."""
    _, report = _bisect_dump(tmp_path, api_planted)
    assert PLANT in report["unreplayable"], report["unreplayable"]
    assert report["culprit"] is None or report["culprit"]["name"] != PLANT
    assert any("could not be replayed" in n for n in report["notes"]), report["notes"]
    assert _only_known_after(report) == [], report["culprits"]


# -- two ranks (torchrun, gloo) ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks_planted(tmp_path_factory):
    """``torchrun --nproc-per-node 2 ... bisect --script --keep`` of ZeRO-2, planted on rank 1 only."""
    where = tmp_path_factory.mktemp("ds2")
    report = where / "bisect.json"
    r = _torchrun("bisect", "--script", SCRIPT, "--keep", str(where / "keep"), "--format", "json",
                  "-o", str(report), "--", "--zero", "2", "--plant-rank", "1")
    return r, _report(report, r), where / "keep"


def test_two_rank_bisect_names_the_plant_on_its_rank(two_ranks_planted):
    r, report, _ = two_ranks_planted
    c = report["culprit"]
    assert r.returncode != 0 and (c["name"], c["direction"], c["rank"]) == (PLANT, "forward", 1), c
    assert c["scope"].endswith("transformer.h.1.mlp.act") and c["found_on_ranks"] == [1], c


def test_both_ranks_dumps_survive_and_their_replicas_agree(two_ranks_planted):
    """ZeRO-2's collectives (the gradient all-reduce, the parameters' all-gather after the step)
    replicate their outputs: ``ranks`` checks them bit for bit (the plant changes rank 1's local
    gradients, not what the collectives agree on)."""
    _, _, keep = two_ranks_planted
    dump = precisiondiff.load(keep)
    assert sorted(dump.ranks) == [0, 1]
    assert all(any(ev.kind == "module" for ev in sub.events()) for sub in dump.ranks.values())
    r = _run("ranks", str(keep), "--json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    checked = json.loads(r.stdout)
    assert checked["checked"] > 0 and checked["by_rule"].get("collective output", 0) > 0 and checked["ok"], checked
    # each rank records the gradients of the parameters its ZeRO partition holds whole, and the
    # lowest holder the one split between both partitions (gathered: capture/deepspeed.py)
    held = [{(ev.scope, t.slot) for ev in sub.events() if ev.kind == "param" for t in ev.tensors}
            for _, sub in sorted(dump.ranks.items())]
    assert held[0] and held[1] and not held[0] & held[1], [len(h) for h in held]
    assert len(held[0] | held[1]) == PARAMS, [len(h) for h in held]


# -- the optimizer and watch (issue 19 item 5) -----------------------------------------------------
@pytest.fixture(scope="module")
def planted_optimizer(tmp_path_factory):
    """``bisect --script --keep --direction optimizer`` of ZeRO-1 trained by ``RoughAdamW`` (a vendor
    AdamW op that stores its first moment through bf16), the client optimizer ZeRO wraps."""
    where = tmp_path_factory.mktemp("dsopt")
    report = where / "bisect.json"
    r = _run("bisect", "--script", SCRIPT, "--keep", str(where / "keep"), "--direction", "optimizer",
             "--format", "json", "-o", str(report), "--", "--zero", "1", "--plant-optimizer")
    return r.returncode, _report(report, r), where / "keep"


def test_a_planted_optimizer_kernel_under_zero_is_named_as_an_optimizer_op(planted_optimizer):
    code, report, _ = planted_optimizer
    c = report["culprit"]
    assert code == 1 and (c["kind"], c["name"], c["direction"]) == \
        ("op", "pdframeworks.rough_adamw_.default", "optimizer"), c
    # ZeRO's wrapped optimizer steps the flat fp32 partition of param group 0: its element-wise ops are
    # recorded per parameter fragment, so the first one of the partition is named (capture/deepspeed.py)
    assert c["scope"] == "optimizer.param_groups.0/module.transformer.wte.weight", c
    names = {c["scope"] for c in report["culprits"]}
    assert len(names) == len(report["culprits"]) and all(n.startswith("optimizer.param_groups.0/module.") for n in names)


def _watch_lines(out: Path) -> list:
    return [json.loads(line) for line in (out / "watch.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def watched_zero2(tmp_path_factory):
    """``watch --script`` of the ZeRO-2 job, one process: its log directory and the printed losses."""
    out = tmp_path_factory.mktemp("dsw") / "watch"
    r = _run("watch", "--script", SCRIPT, "-o", str(out), "--", "--zero", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    return out, _losses(r.stdout)


def test_watch_runs_on_a_zero2_engine_and_keeps_the_losses(watched_zero2, plain_losses):
    out, losses = watched_zero2
    assert losses == plain_losses
    lines = _watch_lines(out)
    steps = [line for line in lines if "step" in line]
    assert [line["step"] for line in steps] == [0, 1]
    assert [round(line["loss"], 6) for line in steps] == [float(x) for x in plain_losses]
    # watch sees through the engine (watch/monitor.py unwrapped): the model's own names, no `module.`
    assert any(k.startswith(("transformer.h.1:", "transformer.h.1.")) for k in steps[0]["tensors"]), sorted(steps[0]["tensors"])
    assert not any(k.startswith("module.") for k in steps[0]["tensors"])


def test_watch_under_zero_logs_every_model_parameter_by_name(watched_zero2):
    """Not the flat fp32 partition (``param.0``): each parameter's fragment of it (watch/zero.py),
    with its gradient, weight, update ratio and AdamW state; the first step's first moment is
    (1 - beta1) times the gradient the optimizer stepped with, element for element."""
    out, _ = watched_zero2
    lines = _watch_lines(out)
    names = [name for name, _ in lines[0]["model"]["params"]]
    steps = [line for line in lines if "step" in line]
    assert len(names) == PARAMS and sorted(steps[0]["params"]) == sorted(names), sorted(steps[0]["params"])[:5]
    for name, fields in steps[0]["params"].items():
        assert set(fields) >= {"grad", "weight", "update_ratio", "state.exp_avg", "state.exp_avg_sq"}, (name, fields)
        assert fields["state.exp_avg"] == pytest.approx(0.1 * fields["grad"], rel=1e-5), (name, fields)
    assert lines[0]["model"]["shards"]["transformer.h.0.mlp.c_proj.weight"]["placements"] == ["ZeRO"]


@pytest.fixture(scope="module")
def watched_zero2_two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dsw2") / "watch"
    r = _torchrun("watch", "--script", SCRIPT, "-o", str(out), "--", "--zero", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_two_rank_zero_watch_combines_to_the_one_rank_norms(watched_zero2_two_ranks, watched_zero2):
    """Each rank logs the parameters it holds a fragment of (one is split between both); their
    norms combined over the ranks (shards.combine_ranks: root sum of squares) are the one-process
    run's, whose fragments are the whole parameters."""
    from precisiondiff.watch.log import read_logs
    from precisiondiff.watch.shards import combine_ranks
    logs = read_logs(watched_zero2_two_ranks)
    assert sorted(logs) == [0, 1]
    held = [set(logs[r].steps[0]["params"]) for r in (0, 1)]
    assert held[0] and held[1] and len(held[0] | held[1]) == PARAMS and len(held[0] & held[1]) == 1, held
    combined = {s["step"]: s["params"] for s in combine_ranks(logs).steps}
    single = {s["step"]: s["params"] for s in read_logs(watched_zero2[0])[0].steps}
    assert sorted(combined) == sorted(single) == [0, 1]
    for step, params in single.items():
        assert sorted(combined[step]) == sorted(params)
        for name, fields in params.items():
            for what, value in fields.items():
                assert combined[step][name][what] == pytest.approx(value, rel=1e-5), (step, name, what)
    # compare combines the layouts the same way (watch/layouts.py): every parameter, within rounding
    r = _run("compare", str(watched_zero2_two_ranks), str(watched_zero2[0]), "--format", "json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    errors = json.loads(r.stdout)["errors"]
    # weights are logged on full steps (step 0 here; docs/watch.md, param_every), gradients every step
    compared = {k.rpartition(":")[0] for k, v in errors.items() if k.endswith(":weight") and v[0] is not None}
    assert len(compared) == PARAMS, sorted(compared)
    assert max(e for k, v in errors.items() if k.endswith((":grad", ":weight")) for e in v if e is not None) < 1e-5


# -- ZeRO-3 (one process) ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def clean_zero3(tmp_path_factory):
    """``bisect --script --keep`` of the clean ZeRO-3 bf16 job: its report and the replay dump."""
    where = tmp_path_factory.mktemp("ds3")
    report = where / "bisect.json"
    r = _run("bisect", "--script", SCRIPT, "--keep", str(where / "keep"), "--format", "json", "-o", str(report),
             "--", "--zero", "3")
    return r.returncode, _report(report, r), where / "keep"


def test_bisect_of_a_clean_zero3_job_gets_no_kernel_verdict(clean_zero3):
    code, report, _ = clean_zero3
    assert report["verdict"] in ("parity", "accumulated") and report["culprits"] == [], report["culprits"]
    assert code == (0 if report["verdict"] == "parity" else 1)
    assert all(a.get("known") for a in report["accepted"]), report["accepted"]


def test_zero3_gradients_modules_and_ops_agree_with_float64(clean_zero3, reference):
    """ZeRO-3 partitions every parameter: capture reads the engine's gradient partitions before
    its step (one rank: the whole parameter; capture/deepspeed.py), in its accumulation dtype."""
    _, _, keep = clean_zero3
    dump = precisiondiff.load(keep)
    grads = [t for ev in dump.events() if ev.kind == "param" for t in ev.tensors]
    assert len(grads) == PARAMS and {t.dtype for t in grads} == {"bfloat16"}, [(t.key, t.dtype) for t in grads][:5]
    assert "ZeRO" in dump.meta["param_grads_from"]
    for kind in ("param", "module", "op"):
        result = precisiondiff.compare(str(keep), str(reference), kind=kind)
        passed = [row for row in result.rows if row.verdict == "pass"]
        assert passed and result.summary["failed"] == 0, (kind, result.summary)
        if kind == "param":
            assert len(passed) == PARAMS, result.summary
        if kind == "op":  # ZeRO-3 reorders lm_head's backward GEMMs and adds gradient copies (align.py)
            assert len(passed) > 150 and {row.kind for row in result.rows} == {"op"}, result.summary


def test_bisect_script_names_the_planted_gelu_under_zero3(tmp_path):
    report = tmp_path / "bisect.json"
    r = _run("bisect", "--script", SCRIPT, "--format", "json", "-o", str(report), "--", "--zero", "3", "--plant")
    out = _report(report, r)
    c = out["culprit"]
    assert r.returncode == 1 and (c["kind"], c["name"], c["direction"]) == ("op", PLANT, "forward"), c
    assert c["scope"].endswith("transformer.h.1.mlp.act") and not c.get("known"), c
    assert _only_known_after(out, 1) == [], out["culprits"]
