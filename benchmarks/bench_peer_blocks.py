"""The peer rule on one large output, measured whole and a block at a time, side by side.

    python benchmarks/bench_peer_blocks.py [--rows 32000 --cols 2048] [--peers 0,2] [--rounds 1]

A bf16 output of ``rows x cols`` elements (the default: `lm_head`'s weight gradient in the
1.1b configuration of bench_scale.py) with a magnitude (``k = 256``) is judged by
``judge_against_peers`` with no peers (the screen every output gets) and with the float32 and
decomposition peers (what an output that fails the screen gets), once in one pass
(``JUDGE_BLOCK_ELEMENTS`` raised above the output) and once a block at a time (the default).
Each judgement runs in a process of its own, which resets its peak resident set
(``/proc/self/clear_refs``) once its inputs exist, so the figure is what the judging adds:
peak ``VmHWM`` minus ``VmRSS`` before the call. Wall and CPU time of the call too; the two modes
alternate (whole first in odd rounds, blocked first in even ones). The verdicts' JSON must be
identical: the benchmark fails otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 2**20
    raise RuntimeError(f"{field} not in /proc/self/status")


def judge_once(rows: int, cols: int, n_peers: int, mode: str) -> dict:
    """One judgement in this process: peak GiB above the inputs, wall and CPU seconds, the verdict."""
    import torch
    from precisiondiff.comparators import peers as P

    torch.manual_seed(0)
    g = torch.randn(rows, cols, dtype=torch.float64)
    d = (g.float() * (1 + 2.0 ** -9 * torch.randn(rows, cols))).bfloat16()
    mag = g.abs() * 16
    ps = {"float32": g.bfloat16(), "decomposition": d.clone()} if n_peers else {}
    if mode == "whole":
        P.JUDGE_BLOCK_ELEMENTS = 1 << 62
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    base = _status("VmRSS")
    t, c = time.perf_counter(), time.process_time()
    verdict = P.judge_against_peers(d, g, ps, magnitude=mag, k=256)
    return dict(peak_gib=_status("VmHWM") - base, wall_s=time.perf_counter() - t, cpu_s=time.process_time() - c,
                verdict=verdict.as_dict(), message=verdict.message)


def _peer_counts(text: str) -> list:
    counts = text.split(",")
    if not counts or any(c not in ("0", "2") for c in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: give 0, 2 or 0,2")
    return [int(c) for c in counts]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32000)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--peers", type=_peer_counts, default="0,2", help="peer counts to run: 0 (the screen) and/or 2")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--child", nargs=2, metavar=("PEERS", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(judge_once(args.rows, args.cols, int(args.child[0]), args.child[1])))
        return 0
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print(f"judge_against_peers on {args.rows} x {args.cols} bf16 (float64 golden {args.rows * args.cols * 8 / 2**30:.2f} GiB)")
    failed = False
    for n_peers in args.peers:
        for r in range(args.rounds):
            results = {}
            for mode in (("whole", "blocked") if r % 2 == 0 else ("blocked", "whole")):
                out = subprocess.run([sys.executable, __file__, "--rows", str(args.rows), "--cols", str(args.cols),
                                      "--child", str(n_peers), mode], env=env, capture_output=True, text=True)
                if out.returncode:
                    print(out.stderr[-2000:])
                    return 1
                results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
            same = results["whole"]["verdict"] == results["blocked"]["verdict"]
            failed |= not same
            for mode in ("whole", "blocked"):
                x = results[mode]
                print(f"peers {n_peers} round {r + 1} {mode:7s}: +{x['peak_gib']:.2f} GiB, {x['wall_s']:.1f} s wall, "
                      f"{x['cpu_s']:.1f} s CPU; passed={x['verdict']['passed']}")
            print(f"  verdicts {'identical' if same else 'DIFFER'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
