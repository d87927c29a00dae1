#!/usr/bin/env bash
# Every staged test executable on the GPU machine with FP4MOE_REQUIRE_GPU=1, cuda_device split
# into three processes by test name (prefill; routing and the one-token layer; the decode
# GEMMs), all at once: most of a test's time is the host's reference and weight packing, which
# the device's 16 cores run side by side (cuda_device alone, one process: ~320 s). Logs go to
# $1 (default /tmp/res) as test-NAME.txt; prints each process's result line and any failure.
# Run from the repo root after ../shared/tools/gpu-stage (and scripts/stage-kernels.sh, whose
# kernel cache it uses when present). Exit status: 0 when every process passed.
# GPU_TESTS_TIMEOUT (400): seconds per process.
set -u
R=${1:-/tmp/res}; mkdir -p "$R"
export FP4MOE_REQUIRE_GPU=1 FP4MOE_GOLDEN_DIR="$PWD/.gpu/golden" RUST_BACKTRACE=1
export FP4MOE_BIN="${FP4MOE_BIN:-$PWD/.gpu/fp4moe}"
export FP4MOE_CACHE_DIR="${FP4MOE_CACHE_DIR:-/tmp/kc-tests}"
mkdir -p "$FP4MOE_CACHE_DIR"
[ -d .gpu/kc ] && cp -n .gpu/kc/* "$FP4MOE_CACHE_DIR"/ 2>/dev/null
to=${GPU_TESTS_TIMEOUT:-400}
pids=()
run() {  # run LOG-NAME EXECUTABLE [ARGS...]
  local name=$1; shift
  timeout "$to" "$@" --test-threads=1 --nocapture > "$R/test-$name.txt" 2>&1 &
  pids+=($!)
}
for t in .gpu/tests/*; do
  n=$(basename "${t%-*}")
  if [[ "$n" == cuda_device* ]]; then
    run "$n-prefill" "$t" prefill
    run "$n-routing" "$t" fused_routing one_token router_logits topk graph_capture
    # Everything else: the names of neither group above.
    run "$n-decode" "$t" --skip prefill --skip fused_routing --skip one_token --skip router_logits \
      --skip topk --skip graph_capture
  else
    run "$n" "$t"
  fi
done
rc=0
for p in ${pids[@]+"${pids[@]}"}; do wait "$p" || rc=1; done
for f in "$R"/test-*.txt; do
  echo "$(basename "$f"): $(grep -E '^test result' "$f" | tr '\n' ' ')"
  grep -E "panicked|FAILED|^error" "$f" | head -5
done
exit $rc
