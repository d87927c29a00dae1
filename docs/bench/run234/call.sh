#!/usr/bin/env bash
# Session 49 call 9 (run 234): the review's fixes to the yardstick (per-block read counts the
# test checks against the active experts' vectors, the grouping compared, logits passed
# through, one counts buffer per layer, __launch_bounds__(256, 8)): its test and the graph test;
# then Nemotron W4A16 at 8 / 256 tokens with --bare-reads (short window) against run 226.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export FP4MOE_REQUIRE_GPU=1 FP4MOE_GOLDEN_DIR="$PWD/.gpu/golden"
rm -rf /tmp/kc && cp -r .gpu/kc /tmp/kc && export FP4MOE_CACHE_DIR=/tmp/kc
t=$(ls .gpu/tests/cuda_device-* | head -1)
timeout 100 "$t" --test-threads=1 bare_read graph_capture 2>&1 | tail -6 | tee "$OUT/test-cuda_device.txt"
timeout 60 .gpu/fp4moe bench --preset nemotron3-nano --tokens 8,256 --bare-reads --settle-ms 0 --min-time-ms 0 \
  --json "$OUT/bench.json" 2>/dev/null | tee "$OUT/bench.txt"
