#!/usr/bin/env bash
# One device call: every staged test with FP4MOE_REQUIRE_GPU=1, compute-sanitizer on the small
# GPU tests, `fp4moe bench` for both presets and modes, and the PyTorch bf16 peer on the same
# presets. Run from the repo root on the GPU machine after ../shared/tools/gpu-stage.
# usage: bash scripts/gpu-run.sh [tests|bench|all]   (results under $OUT)
set -u
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
what="${1:-all}"
export FP4MOE_REQUIRE_GPU=1 FP4MOE_GOLDEN_DIR="$PWD/.gpu/golden" FP4MOE_CACHE_DIR=/tmp/fp4moe-cache RUST_BACKTRACE=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "$what" != bench ]; then
  bash .gpu/run.sh > "$OUT/tests.txt" 2>&1; echo "tests rc=$?"; grep -E "FAILED|panicked|rel err|test result" "$OUT/tests.txt" | tail -40
  san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  if [ -n "$san" ]; then
    for tool in memcheck racecheck; do
      for t in .gpu/tests/moe_golden-* .gpu/tests/cuda_device-*; do
        filt=cuda; case "$t" in *cuda_device*) filt=graph_capture;; esac
        "$san" --tool $tool --error-exitcode 9 "$t" --test-threads=1 $filt > "$OUT/sanitizer-$tool-$(basename "${t%%-*}").txt" 2>&1
        echo "compute-sanitizer $tool $(basename "${t%%-*}"): rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$tool-$(basename "${t%%-*}").txt" | head -1)"
      done
    done
  else
    echo "compute-sanitizer not found"
  fi
fi
if [ "$what" != tests ]; then
  for preset in nemotron3-nano qwen3-30b-a3b; do
    for mode in w4a16 w4a4; do
      .gpu/fp4moe bench --preset $preset --mode $mode --backend cuda --json "$OUT/bench-$preset-$mode.json" 2>&1 | tee -a "$OUT/bench.txt"
    done
    PY=/opt/torch/.venv/bin/python3; [ -x $PY ] || PY=python3
    $PY benches/peers/torch_moe.py --preset $preset --json "$OUT/torch-$preset.json" 2>&1 | tee -a "$OUT/bench.txt"
  done
fi
