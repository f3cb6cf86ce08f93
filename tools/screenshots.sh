#!/usr/bin/env bash
# Regenerate docs/img/tensorboard-scalars.png and docs/img/model-explorer-overlay.png
# (docs/integrations.md). Needs the test extra and Debian's chromium (apt-get install -y chromium).
# Run from the repository root: bash tools/screenshots.sh [WORKDIR]
set -euo pipefail
W=${1:-$(mktemp -d)}
PD="python -m precisiondiff.cli"
PLANTED=tests/integrations/planted.py:build
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT

# TensorBoard: 40 SGD steps of the tiny transformer in bf16 against float64
$PD capture --script examples/train_tiny.py -o "$W/train-bf16" --level module --mode tensors --overwrite -- --dtype bfloat16 --steps 40 >/dev/null
$PD capture --script examples/train_tiny.py -o "$W/train-fp64" --level module --mode tensors --overwrite -- --dtype float64 --steps 40 >/dev/null
$PD report "$W/train-bf16" "$W/train-fp64" --tensorboard "$W/tb" --no-progress || test $? -eq 1
tensorboard --logdir "$W/tb" --host 127.0.0.1 --port 6016 >"$W/tb.log" 2>&1 & pids+=($!)
sleep 8
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1400,900 --virtual-time-budget=20000 \
  --screenshot=docs/img/tensorboard-scalars.png \
  "http://127.0.0.1:6016/#scalars&tagFilter=error%2Fforward%2F(embed%7Cblocks.%5B01%5D%7Chead)%24&_smoothingWeight=0"

# Model Explorer: the planted workload (a bf16-only rough GELU), its bisect culprit in red
$PD capture $PLANTED -o "$W/pdut" --mode tensors --overwrite >/dev/null
$PD capture $PLANTED -o "$W/pref" --target cpu/float64 --mode tensors --overwrite >/dev/null
$PD bisect $PLANTED --format json -o "$W/bisect.json" || test $? -eq 1
$PD report "$W/pdut" "$W/pref" --model-explorer "$W/overlay.json" --bisect "$W/bisect.json" --no-progress || test $? -eq 1
python tools/serve_model_explorer.py $PLANTED "$W/overlay.json" 8089 >"$W/me.log" 2>&1 & pids+=($!)
sleep 15
URL=$(grep -o "http://127.0.0.1:8089/?data=[^ ]*" "$W/me.log")
# click "expand all layers", then an empty spot (hides the tooltip)
python tools/cdp_screenshot.py "$URL" docs/img/model-explorer-overlay.png 16 --at 380,75 --at 850,650
