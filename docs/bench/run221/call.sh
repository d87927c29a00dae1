#!/usr/bin/env bash
# Session 48 call 3 (run 221): the memory yardstick again (run 220's int32 sums read at ~0.75
# TB/s, a fifth of the copy rate: now f32 sums of the same bytes), both presets.
R=/tmp/res; mkdir -p $R; trap 'tar czf "$OUT/res.tgz" -C /tmp res' EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > $R/gpu.txt
PY=/opt/torch/.venv/bin/python3; [ -x $PY ] || PY=python3
for p in nemotron3-nano qwen3-30b-a3b; do
  timeout 200 $PY benches/peers/yardsticks.py --what memory --preset $p --json $R/yardsticks-$p.json > $R/yardsticks-$p.txt 2>&1
  echo "rc=$?"; cat $R/yardsticks-$p.txt
done
