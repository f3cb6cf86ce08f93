"""Capture of real models at every level and mode, in memory and on disk."""
import collections
import os

import pytest
import torch
from torch import nn

import precisiondiff
from precisiondiff.capture import MemorySink, capture
from precisiondiff.capture.serialize import decode_call
from precisiondiff.runtime.targets import Target
from precisiondiff.runtime.workload import load_workload, run_workload

BF16 = Target.parse("cpu/bf16")


def _capture_example(spec, *, level="all", mode="stats", target=BF16, **kw):
    w = load_workload(spec)
    model = target.prepare_model(w.model).eval()
    sink = MemorySink()
    with capture(model=model, level=level, mode=mode, sink=sink, **kw) as cap:
        run_workload(w, target, model=model)
    return sink, model, cap


def _by(sink, **match):
    return [e for e in sink.events if all(e[k] == v for k, v in match.items())]


@pytest.mark.parametrize("mode", ["stats", "tensors", "replay"])
def test_every_linear_has_forward_and_backward_events(example_spec, mode):
    sink, model, _ = _capture_example(example_spec, mode=mode)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 9
    for name in linears:
        fwd = _by(sink, kind="module", scope=name, direction="forward")
        bwd = _by(sink, kind="module", scope=name, direction="backward")
        assert len(fwd) == 1 and len(bwd) == 1, name
        assert fwd[0]["name"] == "Linear"
        assert {t["slot"] for t in bwd[0]["tensors"]} >= {"grad_output.0", "grad_input.0"}
    stored = all(t["data_key"] for e in sink.events for t in e["tensors"])
    assert stored == (mode != "stats")
    assert [e["seq"] for e in sink.events] == list(range(len(sink.events)))


def test_op_events_carry_their_module_scope(example_spec):
    sink, _, _ = _capture_example(example_spec, level="op")
    assert not _by(sink, kind="module")
    addmm = _by(sink, name="aten.addmm.default", direction="forward")
    assert [e["scope"] for e in addmm][:3] == ["blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc1"]
    softmax = _by(sink, name="aten._softmax.default")
    assert softmax and all(e["scope"] == f"blocks.{i}.attn" for i, e in enumerate(softmax))
    backward_ops = _by(sink, kind="op", direction="backward")
    assert any(e["scope"] == "blocks.1.mlp.fc2" and e["name"] == "aten.mm.default" for e in backward_ops)
    assert not any(e["name"].startswith("aten.view") or e["name"] == "aten.t.default" for e in sink.events)


def test_module_level_records_no_ops(example_spec):
    sink, _, _ = _capture_example(example_spec, level="module")
    assert {e["kind"] for e in sink.events} == {"module", "param"}


def test_param_grads_match_p_grad(example_spec):
    sink, model, _ = _capture_example(example_spec, mode="tensors")
    params = dict(model.named_parameters())
    checked = 0
    for ev in _by(sink, kind="param"):
        for rec in ev["tensors"]:
            pname = rec["slot"].removeprefix("param_grad.")
            full = f"{ev['scope']}.{pname}" if ev["scope"] else pname
            assert torch.equal(sink.tensor(rec), params[full].grad), full
            checked += 1
    assert checked == len(params)


def test_custom_op_is_one_event(buggy_spec):
    sink, _, _ = _capture_example(buggy_spec, level="op")
    fused = _by(sink, name="pdexample.fused_rms_norm.default", direction="forward")
    assert [e["scope"] for e in fused] == ["blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1", "blocks.1.norm2"]
    # the ATen ops inside the fused kernel are not recorded as separate events
    assert not _by(sink, scope="blocks.0.norm1", name="aten.rsqrt.default", direction="forward")


def test_replay_args_reexecute_bitwise(example_spec):
    sink, _, _ = _capture_example(example_spec, mode="replay", level="op")
    replayed = 0
    for ev in sink.events[:40]:
        assert ev["args"]["replayable"], ev["name"]
        slots = {t["slot"]: t for t in ev["tensors"]}
        args, kwargs = decode_call(ev["args"], lambda s: sink.tensor(slots[s]))
        ns, op, overload = ev["name"].split(".")
        out = getattr(getattr(getattr(torch.ops, ns), op), overload)(*args, **kwargs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        assert torch.equal(out, sink.tensor(slots["output.0"])), ev["name"]
        replayed += 1
    assert replayed == 40


def test_a_tensor_recorded_twice_is_stored_once(example_spec):
    sink, _, _ = _capture_example(example_spec, mode="tensors", level="op")
    records = [t for e in sink.events for t in e["tensors"]]
    aliases = [t for t in records if t["data_key"] != t["key"]]
    assert len(aliases) > len(records) // 4
    assert len(sink.data) == len({t["data_key"] for t in records})
    # an op's output is the next op's input: same stored data, same stats
    first, second = sink.events[0], sink.events[1]
    out = next(t for t in first["tensors"] if t["slot"] == "output.0")
    inp = next(t for t in second["tensors"] if t["data_key"] == out["data_key"])
    assert inp["stats"] == out["stats"]


def test_stats_are_right(example_spec):
    sink, _, _ = _capture_example(example_spec, mode="tensors", level="op")
    checked = set()
    for ev in sink.events[:30]:
        for rec in ev["tensors"]:
            t = sink.tensor(rec).double()
            s = rec["stats"]
            if t.numel() == 0:
                continue
            assert s["nan"] == t.isnan().sum().item() and s["inf"] == t.isinf().sum().item()
            assert s["min"] == t.min().item() and s["max"] == t.max().item()
            if s["inf"] == 0:
                # 16-bit floats are summed in float32 on the CPU (docs/capture.md)
                rel = 1e-5 if rec["dtype"] in ("bfloat16", "float16") else 1e-12
                assert s["mean"] == pytest.approx(t.mean().item(), rel=rel, abs=1e-9)
                assert s["norm"] == pytest.approx(t.norm().item(), rel=rel)
            checked.add(s["inf"] > 0)
    assert checked == {True, False}  # the causal mask's -inf scores are counted


def test_fingerprint_tells_bitwise_equality(example_spec):
    a, _, _ = _capture_example(example_spec, level="op")
    b, _, _ = _capture_example(example_spec, level="op")
    c, _, _ = _capture_example(example_spec, level="op", target=Target.parse("cpu/fp16"))
    fp = lambda s: [t["stats"]["fingerprint"] for e in s.events for t in e["tensors"]]  # noqa: E731
    assert fp(a) == fp(b)
    assert fp(a) != fp(c)


def test_filters(example_spec):
    sink, _, _ = _capture_example(example_spec, scope=r"^blocks\.1\.", op=r"addmm|mm", scope_exclude="attn")
    assert sink.events
    assert all(e["scope"].startswith("blocks.1.") and "attn" not in e["scope"] for e in sink.events)
    assert all("mm" in e["name"] for e in sink.events if e["kind"] == "op")


def test_steps_and_training_loop_api(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with precisiondiff.capture.capture(tmp_path / "d", model=model, mode="tensors", steps="1-2") as cap:
        for _ in range(4):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            cap.step()
    from precisiondiff.store import load
    dump = load(tmp_path / "d")
    assert dump.complete
    steps = collections.Counter(e.step for e in dump.events())
    assert set(steps) == {1, 2}
    keys = [t.key for e in dump.events() for t in e.tensors]
    assert all(k.startswith(("step1/", "step2/")) for k in keys)
    # parameter gradients are taken before opt.step(), although zero_grad() runs before cap.step()
    grads = [e for e in dump.events() if e.kind == "param"]
    assert {e.step for e in grads} == {1, 2} and len(grads) == 4
    # the optimizer's updates are its own events (direction optimizer), never the model's ops
    updates = [e for e in dump.events() if e.direction == "optimizer"]
    assert {e.step for e in updates} == {1, 2}
    assert all(e.scope.startswith("optimizer.param_groups.0/") for e in updates)
    assert not any(e.kind == "op" and e.name.startswith(("aten.add_", "aten._foreach")) and e.direction != "optimizer"
                   for e in dump.events())


def test_inplace_op_output_is_recorded_after_mutation():
    sink = MemorySink()
    x = torch.ones(3)
    with capture(model=nn.Identity(), sink=sink, mode="tensors", level="op"):
        y = x * 2
        y.add_(1)
    add = next(e for e in sink.events if e["name"] == "aten.add_.Tensor")
    slots = {t["slot"]: t for t in add["tensors"]}
    assert torch.equal(sink.tensor(slots["input.0"]), torch.full((3,), 2.0))
    assert torch.equal(sink.tensor(slots["output.0"]), torch.full((3,), 3.0))
    assert slots["output.0"]["stats"]["mean"] == 3.0


def test_hooks_are_removed_even_on_error():
    model = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="boom"):
        with capture(model=model, sink=MemorySink()):
            raise RuntimeError("boom")
    assert not model._forward_hooks and not model._forward_pre_hooks and not model._backward_hooks
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    assert _get_current_dispatch_mode() is None


def test_global_hooks_capture_unowned_modules():
    sink = MemorySink()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    with capture(model=None, sink=sink, level="module"):
        model(torch.randn(2, 3, requires_grad=True)).sum().backward()
    scopes = {(e["scope"], e["name"], e["direction"]) for e in sink.events if e["kind"] == "module"}
    assert {("", "Sequential", "forward"), ("0", "Linear", "forward"), ("1", "Tanh", "backward")} <= scopes


def test_device_recorded_per_event(example_spec):
    sink, _, _ = _capture_example(example_spec, level="op")
    assert {e["device"] for e in sink.events} == {"cpu"}


@pytest.mark.parametrize("fmt", ["safetensors", "h5"])
def test_capture_to_disk_and_load(tmp_path, example_spec, fmt):
    w = load_workload(example_spec)
    model = BF16.prepare_model(w.model).eval()
    with capture(tmp_path / "d", model=model, mode="tensors", format=fmt, meta={"target": "cpu/bf16"}):
        run_workload(w, BF16, model=model)
    dump = precisiondiff.store.load(tmp_path / "d")
    events = list(dump.events())
    assert dump.meta["target"] == "cpu/bf16" and dump.meta["mode"] == "tensors" and dump.complete
    ev = next(e for e in events if e.kind == "module" and e.scope == "blocks.0.mlp.fc1" and e.direction == "forward")
    out = next(t for t in ev.tensors if t.slot == "output.0")
    assert out.key == "blocks.0.mlp.fc1/Linear#0:forward:output.0"
    assert out.has_data and out.dtype == "bfloat16" and tuple(out.shape) == (2, 16, 256)
    t = dump.tensor(out.key)
    assert t.dtype == torch.bfloat16 and t.double().norm().item() == pytest.approx(out.stats["norm"], rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64,
                                   torch.float8_e4m3fn, torch.int64, torch.bool])
def test_batched_stats_equal_per_tensor_stats(dtype):
    """Small tensors are reduced together; the result must equal reducing each alone."""
    from precisiondiff.capture.stats import StatsBatch
    from precisiondiff.store import fingerprint
    g = torch.Generator().manual_seed(0)
    tensors = [(torch.randn(n, generator=g) * 3).to(dtype) for n in (1, 7, 300, 5)]
    tensors.append(torch.randn(4, 6, generator=g).to(dtype).t())  # non-contiguous
    if dtype.is_floating_point and dtype.itemsize > 1:
        tensors.append(torch.tensor([1.0, float("nan"), float("inf")], dtype=dtype))
    batched, single = StatsBatch(), StatsBatch(small_elements=0)
    handles = [(batched.add(t), single.add(t)) for t in tensors]
    batched.resolve(); single.resolve()
    for t, (hb, hs) in zip(tensors, handles):
        b, s = batched.get(hb), single.get(hs)
        assert b["fingerprint"] == s["fingerprint"] == fingerprint(t)
        rel = 1e-5 if dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn) else 1e-12
        for k in ("min", "max", "mean", "abs_mean", "norm", "nan", "inf"):
            assert b[k] == pytest.approx(s[k], rel=rel, abs=1e-9, nan_ok=True), k


def test_snapshot_is_taken_when_recorded():
    from precisiondiff.capture.stats import StatsBatch
    batch = StatsBatch()
    t = torch.ones(4)
    h = batch.add(t)
    t.mul_(5)  # an in-place update before the batch is read back
    batch.resolve()
    assert batch.get(h)["mean"] == 1.0


def test_multi_rank_runs_write_rank_directories_and_rank_filter(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = nn.Linear(3, 2)
    with capture(tmp_path / "d", model=model, mode="tensors"):
        model(torch.randn(2, 3))
    with capture(tmp_path / "skip", model=model, mode="tensors", ranks="0"):
        model(torch.randn(2, 3))
    from precisiondiff.store import load
    dump = load(tmp_path / "d")
    assert (tmp_path / "d" / "rank1" / "meta.json").is_file()
    events = list(dump.events())
    assert events and all(e.rank == 1 for e in events)
    assert list(load(tmp_path / "skip").events()) == []


def test_reshaped_views_share_statistics_not_data():
    sink = MemorySink()
    with capture(model=nn.Identity(), sink=sink, mode="tensors", level="op", views=False):
        x = torch.arange(12.0) * 2          # recorded: mul output
        y = x.view(3, 4)                     # a view op: not recorded
        z = y.sum(dim=0)                     # its input is the reshaped view of x
    mul = next(e for e in sink.events if e["name"] == "aten.mul.Tensor")
    total = next(e for e in sink.events if e["name"] == "aten.sum.dim_IntList")
    out = next(t for t in mul["tensors"] if t["slot"] == "output.0")
    inp = next(t for t in total["tensors"] if t["slot"] == "input.0")
    assert inp["shape"] == [3, 4] and inp["stats"] == out["stats"]
    assert torch.equal(sink.tensor(inp), torch.arange(12.0).view(3, 4) * 2)
    assert torch.equal(sink.tensor(next(t for t in total["tensors"] if t["slot"] == "output.0")), z)


def test_statistics_of_huge_bf16_values_stay_finite_on_the_cpu():
    from precisiondiff.capture.stats import StatsBatch
    batch = StatsBatch()
    small, large = torch.full((100,), 1e20).to(torch.bfloat16), torch.full((70000,), 1e20).to(torch.bfloat16)
    hs, hl = batch.add(small), batch.add(large)
    batch.resolve()
    for h, n in ((hs, 100), (hl, 70000)):
        s = batch.get(h)
        assert s["norm"] == pytest.approx(float(small[0]) * n ** 0.5, rel=1e-6) and s["inf"] == 0


def test_dedup_window_is_bounded_in_bytes():
    from precisiondiff.capture.recorder import Recorder
    rec = Recorder(MemorySink(), dedup_bytes=1 << 20)
    for _ in range(10):
        ev = rec.begin("op", "", "aten.add.Tensor", "forward")
        rec.add(ev, "output.0", torch.ones(1 << 17))  # 512 KiB each
        rec.finish(ev)
    assert rec._kept_bytes <= 1 << 20 and len(rec._seen) <= 2


def test_documented_read_loop_works_on_multi_rank_dumps(tmp_path, monkeypatch):
    from precisiondiff.store import load
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        model = nn.Linear(3, 2)
        with capture(tmp_path / "d", model=model, mode="tensors", meta={"target": "cpu/fp32"}):
            model(torch.randn(2, 3))
    dump = load(tmp_path / "d")
    assert dump.meta["target"] == "cpu/fp32" and dump.meta["mode"] == "tensors" and dump.meta["ranks"] == [0, 1]
    seen = set()
    for ev in dump.events():
        for t in ev.tensors:
            assert dump.tensor(t.key).shape == tuple(t.shape)
            seen.add(ev.rank)
    assert seen == {0, 1}


RESNET = os.path.join(os.path.dirname(os.path.dirname(__file__)), "workloads", "resnet.py") + ":build"


@pytest.mark.parametrize("level", ["module", "all"])
def test_models_with_inplace_outputs_are_captured(level):
    """nn.ReLU(inplace=True) after BatchNorm and `out += x` (torchvision's ResNets) must not
    break module-level backward capture."""
    sink, model, _ = _capture_example(RESNET, level=level, mode="tensors")
    bwd = _by(sink, kind="module", scope="3.bn1", direction="backward")
    assert len(bwd) == 1 and {t["slot"] for t in bwd[0]["tensors"]} == {"grad_output.0", "grad_input.0"}


def test_module_backward_gradients_equal_module_hooks(example_spec):
    """grad_output / grad_input recorded from the autograd graph are exactly what
    register_full_backward_hook sees (the module's own contribution to its input's gradient)."""
    w = load_workload(example_spec)
    model = Target.parse("cpu/float64").prepare_model(w.model).eval()
    inputs = Target.parse("cpu/float64").prepare_inputs(w.inputs)
    expected = {}

    def hook(name):
        def fn(module, grad_input, grad_output):
            expected[name] = (grad_output[0].clone(), grad_input[0].clone() if grad_input[0] is not None else None)
        return fn
    names = ["blocks.0.norm1", "blocks.0.attn", "blocks.1.mlp", "blocks.1.mlp.fc1", "norm"]
    handles = [dict(model.named_modules())[n].register_full_backward_hook(hook(n)) for n in names]
    run_workload(w, Target.parse("cpu/float64"), model=model, inputs=inputs)
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    sink = MemorySink()
    with capture(model=model, level="module", mode="tensors", sink=sink):
        run_workload(w, Target.parse("cpu/float64"), model=model, inputs=inputs)
    for name in names:
        ev = _by(sink, kind="module", scope=name, direction="backward")[0]
        slots = {t["slot"]: sink.tensor(t) for t in ev["tensors"]}
        assert torch.allclose(slots["grad_output.0"], expected[name][0], rtol=1e-12, atol=0), name
        assert torch.allclose(slots["grad_input.0"], expected[name][1], rtol=1e-12, atol=1e-300), name


def test_inplace_op_replays_from_its_input_not_its_output():
    sink = MemorySink()
    with capture(model=nn.Identity(), sink=sink, mode="replay", level="op"):
        y = torch.ones(3) * 2
        y.add_(torch.full((3,), 5.0))
    ev = next(e for e in sink.events if e["name"] == "aten.add_.Tensor")
    assert ev["args"]["args"][0] == {"t": "input.0"}
