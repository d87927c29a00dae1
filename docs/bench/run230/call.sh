#!/usr/bin/env bash
# Session 49 call 5 (run 230): DEAD_L2 (gemm_common.cuh, a define): the prefill tiles stream
# their weights with an L2 evict-first policy, GEMM1's last block of each expert discards its
# sorted operand rows from L2 and the combine discards the pair outputs it has read (no
# write-back of dead intermediates; run 229 found the sorted copy costing the following read
# ~7 µs at 256 tokens beyond its own time). Tests under the define (cuda_device's prefill,
# graph-capture, token-order and yardstick tests, moe_golden, moe_random); then base / dead at
# 64-4096 tokens with --stages, both presets, two rounds, the short window.
# (The code: docs/experiments/dead-l2.patch, before run 231 split DEAD_L2 into _W and _D.)
export AB_TESTS=1 AB_TEST_FILTER="prefill graph_capture token_order bare_read" AB_TEST_ENV="FP4MOE_DEFINES=DEAD_L2=1"
export AB_ROUNDS=2 AB_TOKENS=64,128,256,512,1024,4096 AB_DEADLINE=480 AB_TEST_TIMEOUT=240
export AB_BENCH_ARGS="--stages"
export AB_VARIANTS="base=.gpu/fp4moe dead=.gpu/fp4moe@FP4MOE_DEFINES=DEAD_L2=1"
bash scripts/gpu-ab.sh 2>&1 | tail -16
mkdir -p "${OUT:-/tmp/out}" && tar czf "${OUT:-/tmp/out}/res.tgz" -C /tmp/res .
