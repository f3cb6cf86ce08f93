"""Per-event capture cost on a model of many tiny ops, and module-level capture on 12 blocks.

    python benchmarks/bench_capture_events.py [--ops 2000] [--repeats 5] [--profile] [--breakdown] [--long 20000]

Part 1: a forward of ``--ops`` elementwise ops on 64-element float32 tensors (no module
boundaries inside), plain vs op-level statistics capture into a dump; the capture session is
entered and closed inside the timed block. Prints microseconds per recorded op event:
(captured - plain) / events. Part 2: the 12-block example transformer, forward + backward,
plain vs module-level statistics capture: the ratio (a session per step, and one session open
across the steps). Plain and captured runs are interleaved.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import precisiondiff.capture as cap_mod  # noqa: E402


class TinyOps(nn.Module):
    """``ops`` elementwise ops on a 64-element tensor, one module."""

    def __init__(self, ops: int) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.ops // 2):
            x = torch.sin(x)
            x = x * 1.0001
        return x


CLOCK = time.perf_counter  # --clock cpu: time.process_time (all threads; steadier on a loaded machine)
STAT = statistics.median  # --stat min: the least disturbed repeat (other jobs only ever add time)


def _median_pair(plain_fn, captured_fn, repeats: int):
    plain, captured = [], []
    for rep in range(repeats + 1):
        t0 = CLOCK()
        plain_fn()
        t1 = CLOCK()
        captured_fn(rep)
        t2 = CLOCK()
        if rep:
            plain.append(t1 - t0)
            captured.append(t2 - t1)
    return STAT(plain), STAT(captured)


def tiny_ops(ops: int, repeats: int, tmp: str, profile: bool, memory: bool = False) -> None:
    model = TinyOps(ops)
    x = torch.randn(64)
    events = [0]

    def captured(rep):
        sink = cap_mod.MemorySink() if memory else None
        with cap_mod.capture(os.path.join(tmp, f"ops{rep}"), model=model, level="op", mode="stats",
                             overwrite=True, sink=sink) as cap:
            with torch.no_grad():
                model(x)
        events[0] = cap.recorder.events_written

    def plain():
        with torch.no_grad():
            model(x)

    if profile:
        import cProfile
        import pstats
        captured(98)  # imports and caches first
        prof = cProfile.Profile()
        prof.enable()
        captured(99)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    p, c = _median_pair(plain, captured, repeats)
    per = (c - p) / max(events[0], 1) * 1e6
    where = "into memory" if memory else "into a dump"
    print(f"tiny ops ({where}): {ops} ops x 64 elements, {events[0]} events: plain {p * 1e3:.2f} ms, "
          f"op/stats capture {c * 1e3:.2f} ms, {per:.1f} us per recorded op event (goal <= 10)")


def engines(ops: int, repeats: int, tmp: str, memory: bool) -> None:
    """The tiny-ops forward plain, under the Python engine and under the compiled engine
    (capture/compiled.py), interleaved in one loop: us per recorded op event of each, side by side."""
    from precisiondiff.capture import compiled
    if compiled.load() is None:
        print(f"engines: the compiled hook is unavailable here ({compiled.unavailable_reason()})")
        return
    model = TinyOps(ops)
    x = torch.randn(64)
    times = {"plain": [], "python": [], "compiled": []}
    events = {}
    for rep in range(repeats + 1):
        for name in times:
            t0 = CLOCK()
            if name == "plain":
                with torch.no_grad():
                    model(x)
            else:
                sink = cap_mod.MemorySink() if memory else None
                with cap_mod.capture(os.path.join(tmp, f"eng-{name}"), model=model, level="op", mode="stats",
                                     overwrite=True, sink=sink, engine=name) as cap:
                    with torch.no_grad():
                        model(x)
                events[name] = cap.recorder.events_written
            if rep:  # the first round builds caches
                times[name].append(CLOCK() - t0)
    p = STAT(times["plain"])
    where = "into memory" if memory else "into a dump"
    per = {n: (STAT(times[n]) - p) / max(events[n], 1) * 1e6 for n in ("python", "compiled")}
    print(f"engines ({where}): {ops} ops x 64 elements, {events['compiled']} events: plain {p * 1e3:.2f} ms; us per "
          f"recorded op event: python {per['python']:.1f}, compiled {per['compiled']:.1f} "
          f"({per['compiled'] / per['python']:.2f}x; goal <= 10 us)")


def long_capture(ops: int, repeats: int) -> None:
    """One session over ``ops`` tiny ops, as a long step or training run records them: the
    de-duplication window full, the garbage collector's full collections included (a min over
    short runs leaves those out). Events go nowhere (a sink that drops them), so only capture's
    own objects stay alive. Prints microseconds per op event, total, median of the repeats."""
    import gc

    class Drop(cap_mod.MemorySink):
        def write_event(self, event, data) -> None:
            pass

    model = TinyOps(ops)
    x = torch.randn(64)
    full = [0, 0.0]
    start = [0.0]

    def count(phase, info):
        if info["generation"] == 2:
            if phase == "start":
                start[0] = time.perf_counter()
            else:
                full[0] += 1
                full[1] += time.perf_counter() - start[0]

    def captured(rep):
        with cap_mod.capture(None, model=model, level="op", mode="stats", sink=Drop()):
            with torch.no_grad():
                model(x)

    def plain():
        with torch.no_grad():
            model(x)

    gc.callbacks.append(count)
    stat = globals()["STAT"]
    try:
        globals()["STAT"] = statistics.median  # every repeat counts: full collections are part of the cost
        p, c = _median_pair(plain, captured, repeats)
    finally:
        globals()["STAT"] = stat
        gc.callbacks.remove(count)
    print(f"long capture: {ops} ops in one session: plain {p * 1e3:.1f} ms, op/stats capture {c * 1e3:.1f} ms, "
          f"{(c - p) / ops * 1e6:.1f} us per recorded op event; full collections {full[0]} "
          f"({full[1] * 1e3:.0f} ms wall in all, {repeats + 1} captures; median of {repeats})")


def breakdown(ops: int, repeats: int, tmp: str) -> None:
    """Where a recorded op event's time goes: the same forward under progressively more of capture
    (statistics stubbed out by a constant: what the rest of the recorder costs without them)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from precisiondiff.capture import stats as stats_mod

    model = TinyOps(ops)
    x = torch.randn(64)

    class Empty(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def run(mode=None, sink="none"):
        def go():
            if mode is not None:
                with mode(), torch.no_grad():
                    model(x)
            elif sink == "none":
                with torch.no_grad():
                    model(x)
            else:
                with cap_mod.capture(os.path.join(tmp, "bd"), model=model, level="op", mode="stats",
                                     overwrite=True, sink=cap_mod.MemorySink() if sink == "memory" else None):
                    with torch.no_grad():
                        model(x)
        return go

    from precisiondiff.capture import recorder as rec_mod

    real = {(cls, name): getattr(cls, name) for cls, name in (
        (stats_mod.StatsBatch, "add"), (stats_mod.StatsBatch, "get"), (rec_mod.Recorder, "add"),
        (rec_mod.Recorder, "finish"))}
    const = {"min": 0.0, "max": 0.0, "mean": 0.0, "abs_mean": 0.0, "norm": 0.0, "nan": 0, "inf": 0,
             "fingerprint": "0" * 32}

    def stubbed(*names):
        """The capture into memory with these parts replaced by a no-op (statistics: a constant)."""
        stubs = {"stats": [(stats_mod.StatsBatch, "add", lambda self, t, snapshot=None: 0),
                           (stats_mod.StatsBatch, "get", lambda self, handle: const)],
                 "add": [(rec_mod.Recorder, "add", lambda self, event, slot, t, store=True, fresh=False: None)],
                 "finish": [(rec_mod.Recorder, "finish", lambda self, event, args=None: None)]}

        def go():
            for name in names:
                for cls, attr, stub in stubs[name]:
                    setattr(cls, attr, stub)
            try:
                run(sink="memory")()
            finally:
                for (cls, attr), f in real.items():
                    setattr(cls, attr, f)
        return go

    # each row adds one part of capture to the row above it
    variants = {"plain op": run(), "empty TorchDispatchMode": run(mode=Empty),
                "capture's mode: dispatch bookkeeping only": stubbed("add", "finish", "stats"),
                "+ Recorder.add (statistics stubbed)": stubbed("finish", "stats"),
                "+ statistics (StatsBatch.add)": stubbed("finish"),
                "+ finish, read-back, event records": run(sink="memory"),
                "+ into a dump instead of memory": run(sink="dump")}
    times = {k: [] for k in variants}
    for f in variants.values():
        f()
    for _ in range(repeats):
        for k, f in variants.items():
            t0 = CLOCK()
            f()
            times[k].append(CLOCK() - t0)
    print(f"breakdown ({ops} ops, {STAT.__name__} of {repeats}, us per op):")
    prev = None
    for k, v in times.items():
        us = STAT(v) / ops * 1e6
        step = f" (+{us - prev:.1f})" if prev is not None else ""
        print(f"  {k:<42s} {us:7.2f}{step}")
        prev = us


def twelve_blocks(repeats: int, tmp: str) -> None:
    """Module/stats capture on the 12-block example, a session entered and closed around every
    step: the ratio to a plain step. Interleaved with it in the same loop, the floor: the same
    step with an empty forward pre-hook and hook on every module (what PyTorch's hooked module
    call costs), and a session entered and closed around nothing before a plain step."""
    import functools

    from precisiondiff.runtime.targets import Target
    from precisiondiff.runtime.workload import load_workload, run_workload
    target = Target.parse("cpu/bf16")
    workload = load_workload("examples/tiny_transformer.py:build_12_layers")
    model = target.prepare_model(workload.model).eval()
    inputs = target.prepare_inputs(workload.inputs)

    def step():
        run_workload(workload, target, model=model, inputs=inputs)
        model.zero_grad(set_to_none=True)

    def captured(rep):
        with cap_mod.capture(os.path.join(tmp, f"mod{rep}"), model=model, level="module", mode="stats",
                             overwrite=True):
            step()

    def empty_hooks(rep):
        def nothing(*args):
            return None
        handles = []
        for m in model.modules():
            handles.append(m.register_forward_pre_hook(functools.partial(nothing, rep), with_kwargs=True))
            handles.append(m.register_forward_hook(functools.partial(nothing, rep), with_kwargs=True,
                                                   always_call=True))
        step()
        for h in handles:
            h.remove()

    def session_only(rep):
        with cap_mod.capture(os.path.join(tmp, f"empty{rep}"), model=model, level="module", mode="stats",
                             overwrite=True):
            pass
        step()

    step()
    times: dict = {"plain": [], "capture": [], "hooks": [], "session": []}
    runs = {"plain": lambda rep: step(), "capture": captured, "hooks": empty_hooks, "session": session_only}
    for rep in range(repeats + 1):
        for name, run in runs.items():
            t0 = CLOCK()
            run(rep)
            if rep:
                times[name].append(CLOCK() - t0)
    p, c, h, e = (STAT(times[k]) for k in ("plain", "capture", "hooks", "session"))
    print(f"12 blocks: plain step {p * 1e3:.2f} ms, module/stats capture {c * 1e3:.2f} ms, "
          f"ratio {c / p:.2f} (goal <= 1.5)")
    print(f"  floor: empty module hooks {h / p:.3f}x, a session entered and closed around nothing "
          f"+ a plain step {e / p:.3f}x")
    # A training loop's capture: one session open across the steps, session.step() after each (no
    # entry and exit per step). Plain steps cannot run inside it (they would be recorded): blocks of
    # plain steps and of captured steps alternate instead.
    plain_steps, open_steps = [], []
    for block in range(3):
        for _ in range(max(3, repeats // 3)):
            t0 = CLOCK()
            step()
            plain_steps.append(CLOCK() - t0)
        with cap_mod.capture(os.path.join(tmp, f"open{block}"), model=model, level="module", mode="stats",
                             overwrite=True) as session:
            for i in range(max(3, repeats // 3) + 1):
                t0 = CLOCK()
                step()
                session.step()
                if i:
                    open_steps.append(CLOCK() - t0)
    p_open, c_open = STAT(plain_steps), STAT(open_steps)
    print(f"  one session open across the steps: plain {p_open * 1e3:.2f} ms, captured step "
          f"{c_open * 1e3:.2f} ms, ratio {c_open / p_open:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of one captured run")
    parser.add_argument("--only", choices=("ops", "blocks"), default=None)
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the tiny-ops forward under an empty dispatch mode and with statistics stubbed")
    parser.add_argument("--long", type=int, default=0, metavar="OPS",
                        help="also one session over OPS tiny ops (e.g. 20000): full collections included")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: process CPU time, every thread (steadier when other jobs share the cores)")
    parser.add_argument("--stat", choices=("median", "min"), default="median")
    parser.add_argument("--engines", action="store_true",
                        help="only the tiny-ops forward under the Python and the compiled engine, side by side")
    args = parser.parse_args()
    global CLOCK, STAT
    if args.clock == "cpu":
        CLOCK = time.process_time
    if args.stat == "min":
        STAT = min
    print(f"clock: {args.clock}, {args.stat} of {args.repeats} repeats, load average {os.getloadavg()[0]:.1f}, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.engines:
            engines(args.ops, args.repeats, tmp, memory=True)
            engines(args.ops, args.repeats, tmp, memory=False)
            return
        if args.only in (None, "ops"):
            tiny_ops(args.ops, args.repeats, tmp, args.profile)
            tiny_ops(args.ops, args.repeats, tmp, False, memory=True)
            if args.breakdown:
                breakdown(args.ops, args.repeats, tmp)
            if args.long:
                long_capture(args.long, max(1, args.repeats // 3))
        if args.only in (None, "blocks"):
            twelve_blocks(args.repeats, tmp)


if __name__ == "__main__":
    main()
