#!/usr/bin/env bash
# Session 49 call 6 (run 231): run 230's DEAD_L2 build hit CUDA_ERROR_ILLEGAL_INSTRUCTION from 128
# tokens (the prefill tiles) and passed at 64. Split in two defines, the weights' copies under
# the evict-first policy now without the zero-fill operand (zero-filled pieces keep the plain
# copy): w (DEAD_L2_W=1; its kernels compiled there) and wd (with DEAD_L2_D=1: the discards) against base at 128 / 256 /
# 512 tokens, both presets, one round, the short window; cuda_device's prefill golden, small
# batch and graph tests under wd first.
export AB_TESTS=1 AB_TEST_FILTER="prefill_golden prefill_small graph_capture" AB_TEST_ENV="FP4MOE_DEFINES=DEAD_L2_W=1+DEAD_L2_D=1"
export AB_ROUNDS=1 AB_TOKENS=128,256,512 AB_DEADLINE=300 AB_TEST_TIMEOUT=120
export AB_VARIANTS="base=.gpu/fp4moe w=.gpu/fp4moe@FP4MOE_DEFINES=DEAD_L2_W=1 wd=.gpu/fp4moe@FP4MOE_DEFINES=DEAD_L2_W=1+DEAD_L2_D=1"
bash scripts/gpu-ab.sh 2>&1 | tail -16
grep -h "error" /tmp/res/ab-*.txt | head
mkdir -p "${OUT:-/tmp/out}" && tar czf "${OUT:-/tmp/out}/res.tgz" -C /tmp/res .
