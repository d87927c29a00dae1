#!/usr/bin/env bash
# run 181 (session 40): the final rules (half from 3 tokens, gated GEMM1 deep from 6, the gated one-token layer on):
# every GPU test; A/B new against the shapes of the rule before (ww: wide:wide + one-token layer off, dd: deep:deep)
# at 1-8 tokens, both presets, W4A16, two rounds; the documentation sweep.
cd "$(dirname "$0")/.."
AB_VARIANTS="new=.gpu/fp4moe ww=.gpu/fp4moe@FP4MOE_GEMM_SHAPE=wide:wide,FP4MOE_ONE_TOKEN=0 dd=.gpu/fp4moe@FP4MOE_GEMM_SHAPE=deep:deep" \
AB_TOKENS=1,2,3,4,5,6,8 AB_ROUNDS=2 AB_DEADLINE=330 AB_SWEEP=1 bash scripts/gpu-ab.sh
# then, warm: .gpu/fp4moe bench --preset P --tokens T --backend cuda --stages for qwen3-30b-a3b 3, 4 and nemotron3-nano 3
# (stages-*.txt)
