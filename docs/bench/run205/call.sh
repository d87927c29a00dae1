#!/usr/bin/env bash
# Session 45 call 3 (run 205; run 204 had not registered the n2 kernels): the deep decode shape with two token subtiles (`*_deep_n2`: 8
# warps, one row group each over the whole K, 16 tokens per pass, two blocks per SM, four k
# groups in flight; FP4MOE_DEEP_N2=1 with FP4MOE_GEMM_SHAPE=deep and FP4MOE_DECODE_NSUB=2)
# against the default plan (prefill 32-token tiles from 5.75 / 7.25 tokens per expert) and the
# wide two-subtile decode kernels, at 96-512 tokens, both presets, two rounds. Tests: the deep
# and handoff shape tests with the n2 kernels forced (bitwise the wide n2 kernels'), moe_golden
# and moe_random under the same knobs.
export AB_TESTS=1 AB_ROUNDS=2 AB_TOKENS=96,128,192,256,384,512 AB_DEADLINE=420 AB_TEST_TIMEOUT=200
export AB_TEST_FILTER="deep_decode_shape_matches_wide expert_handoff_matches_the_full_wait"
export AB_TEST_ENV="FP4MOE_DEEP_N2=1 FP4MOE_DECODE_NSUB=2"
D=FP4MOE_GEMM_PATH=decode,FP4MOE_GEMM_SHAPE=deep,FP4MOE_DECODE_NSUB=2,FP4MOE_DEEP_N2=1
export AB_VARIANTS="new=.gpu/fp4moe deep2=.gpu/fp4moe@$D deep2b3=.gpu/fp4moe@$D,FP4MOE_DEFINES=DECODE_DEEP2_BLOCKS=3+DECODE_DEEP2_DEPTH=3"
bash scripts/gpu-ab.sh 2>&1 | tail -40
