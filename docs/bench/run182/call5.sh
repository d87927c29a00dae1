#!/usr/bin/env bash
# run 182 (session 40): the review's test additions: deep/half vs wide bitwise with partial blocks (H 208, I 80),
# the handoff and one-token tests.
cd "$(dirname "$0")/.."
mkdir -p /tmp/kc; cp .gpu/kc/* /tmp/kc/ 2>/dev/null
FP4MOE_CACHE_DIR=/tmp/kc FP4MOE_REQUIRE_GPU=1 FP4MOE_GOLDEN_DIR=$PWD/.gpu/golden timeout 200 .gpu/tests/cuda_device-* deep_decode expert_handoff one_token --test-threads=1 --nocapture > $OUT/test.txt 2>&1
echo "rc $?"; grep -E "^test |test result|bitwise" $OUT/test.txt | tail -30
