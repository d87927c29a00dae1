#!/usr/bin/env bash
# Session 46 call 1 (run 208): the deep decode blocks whose row groups end within their first
# half run as half blocks (DECODE_TAIL_HALF, non-gated; Nemotron GEMM1's last block of every
# expert): every GPU test on the new build; A/B base (49cd9d6) / new / sm90 (the base binary
# with FP4MOE_CUDA_ARCH=sm_90: mma.sync prefill tiles fed by cp.async, the mma.sync router) at
# 6-256 tokens, both presets, two rounds, the short window; then stages of the new build at
# 1024 / 4096 / 16384 tokens (sustained timing) and of base / sm90 at 128 / 256 tokens.
# Staged: gpu-stage (new), scripts/stage-alt.sh 49cd9d6, scripts/stage-kernels.sh, and the
# base binary's sm_90 kernels compiled into .gpu/alt-49cd9d6/kc (compile-kernels --arch sm_90).
export AB_TESTS=1 AB_ROUNDS=2 AB_TOKENS=6,8,16,32,64,128,256 AB_DEADLINE=360 AB_TEST_TIMEOUT=300
export AB_VARIANTS="base=.gpu/alt-49cd9d6/fp4moe new=.gpu/fp4moe sm90=.gpu/alt-49cd9d6/fp4moe@FP4MOE_CUDA_ARCH=sm_90"
bash scripts/gpu-ab.sh 2>&1 | tail -30
export AB_TESTS=0 AB_ROUNDS=1 AB_DEADLINE=560
AB_VARIANTS="stages=.gpu/fp4moe" AB_TOKENS=1024,4096,16384 AB_BENCH_ARGS=--stages AB_SETTLE_MS=1500 AB_MIN_TIME_MS=500 \
  bash scripts/gpu-ab.sh 2>&1 | tail -4
AB_VARIANTS="stbase=.gpu/alt-49cd9d6/fp4moe stsm90=.gpu/alt-49cd9d6/fp4moe@FP4MOE_CUDA_ARCH=sm_90" AB_TOKENS=128,256 \
  AB_BENCH_ARGS=--stages AB_PRESETS=nemotron3-nano bash scripts/gpu-ab.sh 2>&1 | tail -4
grep -h "stages\|^ *[0-9]* routing" /tmp/res/ab-st*.txt
