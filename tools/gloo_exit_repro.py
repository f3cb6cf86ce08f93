"""Reproduce the gloo exit SIGABRT (docs/watch.md, "A gloo job's exit") and count it with and
without precisiondiff's exit guard (runtime/gloo_exit.py)::

    python tools/gloo_exit_repro.py [RUNS]      # RUNS jobs of each kind, alternating (default 6)

Each job is a plain 2-rank DDP script on gloo under torchrun; before its last step each rank gives
its gloo worker threads the idle scheduling class, and three busy loops hold the cores, so a worker
frees its last work late, during the interpreter's finalization. Prints one line per job and the
count of jobs that died of a signal. Linux only; takes ~10 s a job.
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rank_main(guard: bool) -> None:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    if guard:
        from precisiondiff.runtime.gloo_exit import guard_exit
        guard_exit()
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(3):
        if step == 2:
            for tid in os.listdir("/proc/self/task"):
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().strip() == "pt_gloo_runloop":
                        os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
        ddp(torch.randn(8, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


def main(runs: int) -> None:
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    died = {True: 0, False: 0}
    try:
        for i in range(2 * runs):
            guard = i % 2 == 0
            job = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  "--nproc-per-node", "2", __file__, "--rank", "guard" if guard else "bare"],
                                 capture_output=True, text=True, timeout=300,
                                 env={**os.environ, "PYTHONPATH": ROOT, "GLOO_SOCKET_IFNAME": "lo"})
            aborted = "terminate called" in job.stderr
            died[guard] += job.returncode != 0
            print(f"{'guarded' if guard else 'bare':8s} exit {job.returncode}{'  (SIGABRT: terminate called)' if aborted else ''}")
    finally:
        for p in busy:
            p.kill()
    print(f"died: {died[False]} of {runs} bare jobs, {died[True]} of {runs} guarded")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(sys.argv[2] == "guard")
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
