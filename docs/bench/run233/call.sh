#!/usr/bin/env bash
# Session 49 call 8 (run 233): the final main (4898812: the bare-read yardstick, fused routing
# up to 2 tokens; no kernel of the layer changed this session): every GPU test, and
# compute-sanitizer memcheck on the yardstick's test beside them.
export AB_TESTS=1 AB_ROUNDS=0 AB_DEADLINE=400 AB_TEST_TIMEOUT=330
export AB_SANITIZER="memcheck" AB_SANITIZER_FILTER="bare_read" AB_SANITIZER_TIMEOUT=300
export AB_VARIANTS="final=.gpu/fp4moe"
bash scripts/gpu-ab.sh 2>&1 | tail -12
mkdir -p "${OUT:-/tmp/out}" && tar czf "${OUT:-/tmp/out}/res.tgz" -C /tmp/res .
