#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one time-boxed run (a lent GPU machine; docs/performance.md, "On a GPU"):
#
#   bash tools/device_check.sh OUTDIR [SECONDS]
#
# 1. env:     the GPU, torch, CPU count;
# 2. tests:   the CUDA tests (tests/test_gpu.py: cuda/bf16 against cpu/float64 end to end, capture on a lagging
#             side stream, float32 bisect with TF32 on and off; the probe's TF32 card; targets);
# 3. zoo:     false blames on the model zoo with a cuda/bf16 DUT (stock cuBLAS/cuDNN kernels);
# 4. capture: capture overhead on the GPU (instrumented step / plain step, per level and mode);
# 5. profile: where capture's time goes on the GPU (cProfile of one op/stats step);
# 6. scale:   bisect's replay phase with 1, 2, 2 (modules too) and 8 workers on this host's cores (853 M decoder).
#
# PARTS="tests zoo" runs only those parts (default: all, in this order); SCALE_SIZE, SCALE_SEQ, SCALE_WORKERS and
# SCALE_FLAGS (e.g. --modules-on-workers) change the scale part's bisects.
# Each part gets at most its share of SECONDS (default 540) and writes OUTDIR/PART.log as it runs; the
# last lines of each are echoed. Runs with the machine's own python3 and packages (PYTHONPATH=.).
set -u
out=${1:?usage: tools/device_check.sh OUTDIR [SECONDS]}
budget=${2:-540}
mkdir -p "$out"
start=$(date +%s)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PRECISIONDIFF_BUILD_DIR=/tmp/pd-build
PY=${PYTHON:-python3}

left() { echo $((budget - ($(date +%s) - start))); }

part() {  # part NAME SECONDS TAIL_LINES COMMAND...
  local name=$1 cap=$2 lines=$3 rest t0 rc
  shift 3
  case " ${PARTS:-env tests zoo capture profile warm scale} " in *" $name "*) ;; *) return ;; esac
  rest=$(left)
  [ "$cap" -gt "$rest" ] && cap=$rest
  if [ "$cap" -lt 10 ]; then echo "== $name: not run (no time left)"; return; fi
  echo "== $name (at most ${cap} s): $*"
  t0=$(date +%s)
  timeout -k 5 "$cap" "$@" > "$out/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $(($(date +%s) - t0)) s$([ $rc -eq 124 ] && echo ' (stopped at its time limit)')"
  tail -n "$lines" "$out/$name.log"
}

part env 30 20 bash -c "nvidia-smi -L; nproc; free -g | head -2; $PY -c 'import sys, torch, numpy, numba; \
print(sys.version.split()[0], torch.__version__, torch.version.cuda, numpy.__version__, numba.__version__, \
torch.cuda.get_device_name(0), torch.get_num_threads())'"
part tests 150 25 $PY -m pytest -q -p no:cacheprovider -p no:benchmark -rs -n 4 tests/test_gpu.py tests/probe/test_gpu_probe.py \
  tests/test_targets.py
part zoo 90 30 $PY benchmarks/bench_false_blames.py --target cuda/bf16 --evidence "$out/zoo.jsonl"
part capture 60 14 $PY benchmarks/bench_capture.py --workload examples/tiny_transformer.py:build_12_layers \
  --target cuda/bf16 --repeats 5
part profile 60 45 $PY benchmarks/bench_capture.py --workload examples/tiny_transformer.py:build_12_layers \
  --target cuda/bf16 --profile op/stats
# the compare tile's numba kernels compiled once before the timed bisects (a cold cache would be charged to the
# 1-worker run; the capture's kernels are compiled by the capture, which is not compared)
part warm 60 3 $PY -c "from precisiondiff.bisect.workers import warm_kernels; warm_kernels(); print('warm')"
# 853 M at sequence 64 leaves time for three bisects (at 128, 2026-12-04: capture 84 s, 1 worker 129 s, 2 workers 105 s)
# 2m: 2 workers with the module phase on them too (--modules-on-workers; not yet measured on many cores)
part scale 400 16 $PY benchmarks/bench_scale.py --size "${SCALE_SIZE:-1.1b}" --seq "${SCALE_SEQ:-64}" --workers "${SCALE_WORKERS:-2,2m,8}" \
  ${SCALE_FLAGS:-}
echo "== done in $(($(date +%s) - start)) s"
