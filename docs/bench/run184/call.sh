#!/usr/bin/env bash
# Session 41 call 2: the half4 kernel's tests; where deep should take over from half4 (Qwen3);
# Nemotron's GEMM shapes at 5-16 tokens (no code).
export AB_TESTS=1 AB_ROUNDS=2 AB_PRESETS=qwen3-30b-a3b AB_TOKENS=3,4,5,6,7,8,10,12,14,16,20 AB_DEADLINE=420
export AB_MODES="w4a16 w4a4"
export AB_VARIANTS="new=.gpu/fp4moe h3=.gpu/fp4moe@FP4MOE_GEMM_SHAPE=half:auto h4=.gpu/fp4moe@FP4MOE_GEMM_SHAPE=half4:auto dp=.gpu/fp4moe@FP4MOE_GEMM_SHAPE=deep:auto"
bash scripts/gpu-ab.sh
export AB_TESTS=0 AB_MODES=w4a16 AB_PRESETS=nemotron3-nano AB_TOKENS=5,6,8,10,12,16 AB_DEADLINE=150
export AB_VARIANTS="nnew=.gpu/fp4moe nhd=.gpu/fp4moe@FP4MOE_GEMM_SHAPE=half:deep ndh=.gpu/fp4moe@FP4MOE_GEMM_SHAPE=deep:half nhh=.gpu/fp4moe@FP4MOE_GEMM_SHAPE=half"
bash scripts/gpu-ab.sh
tail -5 /tmp/res/test-*.txt
