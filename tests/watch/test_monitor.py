"""The watch session: what it measures, that it never changes the run, and that it never raises."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import precisiondiff
from precisiondiff.capture.stats import StatsBatch
from precisiondiff.errors import PrecisionDiffError
from precisiondiff.watch import WatchWarning, read_logs
from precisiondiff.watch.monitor import layer_modules

from . import train


@pytest.mark.parametrize("options", [{}, {"level": "all", "param_every": 1}])
def test_watched_training_is_bitwise_equal_to_unwatched(tmp_path, options):
    plain = train.train(5)
    watched = train.train(5, watch_dir=str(tmp_path), watch_options=options)
    assert plain.keys() == watched.keys()
    differs = [k for k in plain if not torch.equal(plain[k], watched[k])]
    assert differs == []


def test_a_step_record_holds_layers_parameters_and_the_loss(tmp_path):
    model, opt, tokens = train.build()
    with precisiondiff.watch(tmp_path, model=model, optimizer=opt, param_every=2) as w:
        losses = []
        for _ in range(3):
            loss = train.train_step(model, opt, tokens)
            losses.append(loss.item())
            w.step(loss=loss)
    log = read_logs(tmp_path)[0]
    assert log.complete and [r["step"] for r in log.steps] == [0, 1, 2]
    assert [r["loss"] for r in log.steps] == pytest.approx(losses, rel=1e-6)
    layers = sorted(set(layer_modules(model).values()))
    assert log.header["model"]["modules"] == layers
    first = log.steps[0]
    forward = [k for k in first["tensors"] if k.endswith(":output")]
    assert forward[:4] == ["embed:output", "blocks.0:output", "blocks.1:output", "blocks.2:output"]
    assert "blocks.1:grad_output" in first["tensors"] and "blocks.1.mlp:output" not in first["tensors"]
    # the norm in the log is the tensor's L2 norm
    x = model.embed(tokens)
    assert first["tensors"]["embed:output"][4] == pytest.approx(torch.linalg.vector_norm(x.double()).item(), rel=1e-3)
    # full steps (every param_every-th: 0 and 2) hold weight, state and update norms; light ones the gradient's
    full, light = log.steps[2]["params"]["head.weight"], log.steps[1]["params"]["head.weight"]
    assert set(full) == {"grad", "weight", "update_ratio", "state.exp_avg", "state.exp_avg_sq"}
    assert set(light) == {"grad"}
    assert 0 < full["update_ratio"] < 0.1 and math.isclose(
        full["weight"], torch.linalg.vector_norm(opt.param_groups[0]["params"][-2].detach()).item(), rel_tol=1e-5)
    assert math.isclose(full["state.exp_avg"], opt.state[opt.param_groups[0]["params"][-2]]["exp_avg"].norm().item(),
                        rel_tol=1e-5)


def test_parameters_an_optimizer_gains_during_the_run_are_watched_from_its_next_step(tmp_path):
    # progressive unfreezing: the optimizer starts with the head, the blocks join at step 2
    model, _, tokens = train.build()
    head = [p for n, p in model.named_parameters() if n.startswith("head")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("head")]
    opt = torch.optim.AdamW(head, lr=1e-3)
    with precisiondiff.watch(tmp_path, model=model, optimizer=opt, param_every=1) as w:
        for step in range(4):
            if step == 2:
                opt.add_param_group({"params": rest})
            w.step(loss=train.train_step(model, opt, tokens))
    steps = read_logs(tmp_path)[0].steps
    embed = [p for p in steps[0]["params"] if p.startswith("embed")]
    assert embed == []
    for record in steps[2:]:
        names = set(record["params"])
        assert {"embed.weight", "head.weight"} <= names
        assert {"weight", "update_ratio", "state.exp_avg"} <= set(record["params"]["embed.weight"])


def test_every_n_steps(tmp_path):
    train.train(5, watch_dir=str(tmp_path), watch_options={"every": 2})
    assert [r["step"] for r in read_logs(tmp_path)[0].steps] == [0, 2, 4]


def test_modules_regex_selects_modules(tmp_path):
    train.train(1, watch_dir=str(tmp_path), watch_options={"modules": r"\.mlp\.fc2$"})
    keys = list(read_logs(tmp_path)[0].steps[0]["tensors"])
    assert keys == ["blocks.0.mlp.fc2:output", "blocks.1.mlp.fc2:output", "blocks.2.mlp.fc2:output",
                    "blocks.2.mlp.fc2:grad_output", "blocks.1.mlp.fc2:grad_output", "blocks.0.mlp.fc2:grad_output"]


def test_an_internal_error_is_a_note_and_one_warning_never_an_exception(tmp_path, monkeypatch):
    plain = train.train(4)
    batches = []
    original = StatsBatch.add

    def failing(self, t, **kw):  # each step has its own batch: fail in the second step's
        if self not in batches:
            batches.append(self)
        if len(batches) > 1:
            raise RuntimeError("planted statistics failure")
        return original(self, t, **kw)

    monkeypatch.setattr(StatsBatch, "add", failing)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watched = train.train(4, watch_dir=str(tmp_path))
    assert [str(c.message) for c in caught if c.category is WatchWarning] == [
        "precisiondiff watch stopped at step 1: RuntimeError: planted statistics failure; "
        "the training runs on and the log keeps the steps before"]
    assert all(torch.equal(plain[k], watched[k]) for k in plain)
    log = read_logs(tmp_path)[0]
    assert [r["step"] for r in log.steps] == [0]
    assert log.notes == ["watch stopped at step 1: RuntimeError: planted statistics failure"]


def test_bad_options_are_user_errors(tmp_path):
    model, opt, _ = train.build()
    with pytest.raises(PrecisionDiffError, match="unknown watch level"):
        precisiondiff.watch(tmp_path, model=model, level="some")
    with pytest.raises(PrecisionDiffError, match="at least 1"):
        precisiondiff.watch(tmp_path, model=model, every=0)
    with pytest.raises(PrecisionDiffError, match="bad --modules regex"):
        precisiondiff.watch(tmp_path, model=model, modules="(")
    with pytest.raises(PrecisionDiffError, match="not a torch.optim.Optimizer"):
        precisiondiff.watch(tmp_path, model=model, optimizer=object())
    precisiondiff.watch(tmp_path, model=model).__enter__().close()
    with pytest.raises(PrecisionDiffError, match="exists"):
        precisiondiff.watch(tmp_path, model=model).__enter__()


def test_a_run_that_raises_leaves_a_partial_log(tmp_path):
    model, opt, tokens = train.build()
    with pytest.raises(ValueError):
        with precisiondiff.watch(tmp_path, model=model, optimizer=opt) as w:
            w.step(loss=train.train_step(model, opt, tokens))
            raise ValueError("the training failed")
    log = read_logs(tmp_path)[0]
    assert not log.complete and len(log.steps) == 1


def test_each_rank_of_a_job_writes_its_own_log(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    train.train(2, watch_dir=str(tmp_path))
    logs = read_logs(tmp_path)
    assert list(logs) == [1] and logs[1].path == str(tmp_path / "rank1" / "watch.jsonl")
    assert (logs[1].header["rank"], logs[1].header["world_size"]) == (1, 2)


def test_the_process_groups_outlive_the_run_until_the_watch_closes(tmp_path):
    """The Python process group is the last reference to go (at close), not a DDP Reducer's C++ one
    released with the GIL held: the gloo exit deadlock of docs/watch.md."""
    import gc
    import weakref

    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        group = weakref.ref(dist.group.WORLD)
        model, _, tokens = train.build()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        with precisiondiff.watch(tmp_path / "w", model=ddp, optimizer=opt) as w:
            for _ in range(2):
                w.step(loss=train.train_step(ddp, opt, tokens))
            dist.destroy_process_group()
            del ddp, opt
            gc.collect()
            assert group() is not None  # held by the watch alone
        gc.collect()
        assert group() is None
        assert [r["step"] for r in read_logs(tmp_path / "w")[0].steps] == [0, 1]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_full_steps_copy_the_weights_into_one_kept_buffer_released_at_close(tmp_path):
    model, opt, tokens = train.build()
    with precisiondiff.watch(tmp_path, model=model, optimizer=opt, param_every=1) as w:
        for _ in range(3):
            w.step(loss=train.train_step(model, opt, tokens))
        memory = w._snapshots[id(opt)]
        buffer = memory._flat
        assert buffer is not None and buffer.numel() >= sum(p.numel() * p.element_size() for p in model.parameters())
        w.step(loss=train.train_step(model, opt, tokens))
        assert memory._flat is buffer  # the same memory on every full step
    assert memory._flat is None and not w._snapshots


def test_an_optimizer_replaced_during_the_run_is_let_go_and_its_successor_watched(tmp_path):
    """Script watching (every optimizer of the process): a script that builds a new optimizer
    mid-run (a restart, a new schedule). The watch holds the old one only weakly (by id(), an
    optimizer created later at its address would inherit what was found about it: "no ZeRO
    engine here"), and the new one's updates are logged from its first step."""
    import gc
    import weakref

    from precisiondiff.watch.monitor import Watch

    model, _, tokens = train.build()
    with Watch(tmp_path, global_hooks=True, param_every=1) as w:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        train.train_step(model, opt, tokens)
        gone = weakref.ref(opt)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        gc.collect()
        assert gone() is None
        train.train_step(model, opt, tokens)
    steps = read_logs(tmp_path)[0].steps
    assert len(steps) == 2
    for record in steps:
        assert {"weight", "update_ratio"} <= set(record["params"]["head.weight"])
