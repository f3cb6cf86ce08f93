"""Capture overhead: instrumented step time ÷ plain step time, per level and mode, in one run.

    python benchmarks/bench_capture.py [--workload examples/tiny_transformer.py:build] [--target cpu/bf16]

A step is forward + loss + backward of the workload. Each configuration is timed over
--repeats steps after a warm-up step; plain steps are interleaved with instrumented ones so
machine noise hits both. Dumps go to a temporary directory (stats, tensors, replay modes).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import precisiondiff.capture as hooks  # noqa: E402
from precisiondiff.runtime.targets import Target  # noqa: E402
from precisiondiff.runtime.workload import load_workload, run_workload  # noqa: E402


def _step(workload, target, model, inputs):
    run_workload(workload, target, model=model, inputs=inputs)
    target.synchronize()
    model.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="examples/tiny_transformer.py:build")
    parser.add_argument("--target", default="cpu/bf16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", metavar="LEVEL/MODE", default=None,
                        help="only profile one captured step at LEVEL/MODE (e.g. op/stats) with cProfile")
    args = parser.parse_args()
    if args.profile and (args.profile.count("/") != 1 or args.profile.split("/")[0] not in ("module", "op", "all")
                         or args.profile.split("/")[1] not in ("stats", "tensors", "replay")):
        parser.error(f"--profile {args.profile}: use LEVEL/MODE, LEVEL one of module, op, all and MODE one of "
                     "stats, tensors, replay")
    target = Target.parse(args.target)
    workload = load_workload(args.workload)
    model = target.prepare_model(workload.model).eval()
    inputs = target.prepare_inputs(workload.inputs)
    _step(workload, target, model, inputs)
    if args.profile:
        return _profile(args.profile, workload, target, model, inputs)
    print(f"workload {args.workload} on {target}; ratio = instrumented step / plain step (median of {args.repeats})")
    print(f"{'level':<7} {'mode':<8} {'plain ms':>9} {'captured ms':>12} {'ratio':>7} {'events':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for level in ("module", "op", "all"):
            for mode in ("stats", "tensors", "replay"):
                plain, captured, events = [], [], 0
                for rep in range(args.repeats + 1):
                    t0 = time.perf_counter()
                    _step(workload, target, model, inputs)
                    t1 = time.perf_counter()
                    out = os.path.join(tmp, f"{level}-{mode}-{rep}")
                    with hooks.capture(out, model=model, level=level, mode=mode, steps="0") as cap:
                        _step(workload, target, model, inputs)
                    t2 = time.perf_counter()
                    events = cap.recorder.events_written
                    if rep:  # the first round warms caches
                        plain.append(t1 - t0)
                        captured.append(t2 - t1)
                p, c = statistics.median(plain), statistics.median(captured)
                print(f"{level:<7} {mode:<8} {p * 1e3:9.2f} {c * 1e3:12.2f} {c / p:7.1f} {events:7d}")


def _profile(spec: str, workload, target, model, inputs) -> None:
    """cProfile of the second of two captured steps (the first warms caches), session close included, by own
    time and by cumulative time."""
    import cProfile
    import pstats
    level, _, mode = spec.partition("/")
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(2):
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            if rep:
                prof.enable()
            with hooks.capture(os.path.join(tmp, str(rep)), model=model, level=level, mode=mode, steps="0") as cap:
                _step(workload, target, model, inputs)
            prof.disable()
            wall = time.perf_counter() - t0
    events = cap.recorder.events_written
    print(f"{level}/{mode} on {target}: {wall * 1e3:.1f} ms captured (session close included), {events} events")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(22)
    stats.sort_stats("cumulative").print_stats(18)


if __name__ == "__main__":
    main()
