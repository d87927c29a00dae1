#!/usr/bin/env bash
# Session 46 call 2 (run 209): the dual 128-token tiles fed by cp.async (prefill_dual_cp_*, no
# sorted copy of GEMM1's input in routing): cuda_device's prefill, token-order and graph tests
# (the dual tiles' two feeds bitwise equal; the expert handoff on the new pair), moe_golden,
# moe_random; A/B of one binary: tma (the default), cp1 (FP4MOE_PREFILL_FEED=cp:auto, GEMM1
# cp.async, GEMM2 TMA), cp (both cp.async) at 1024-16384 tokens, both presets, two rounds, the
# short window (Nemotron 8192-16384: GEMM1 runs 256-token tiles by default, which exist TMA-fed
# only, so cp1 / cp run the 128-token cp.async tiles there); then stages of tma / cp1 at 1024
# and 4096 tokens.
export AB_TESTS=1 AB_ROUNDS=2 AB_TOKENS=1024,2048,4096,8192,16384 AB_DEADLINE=380 AB_TEST_TIMEOUT=300
export AB_TEST_FILTER="prefill outputs_do_not graph_capture deep_decode"
export AB_VARIANTS="tma=.gpu/fp4moe cp1=.gpu/fp4moe@FP4MOE_PREFILL_FEED=cp:auto cp=.gpu/fp4moe@FP4MOE_PREFILL_FEED=cp"
bash scripts/gpu-ab.sh 2>&1 | tail -30
export AB_TESTS=0 AB_ROUNDS=1 AB_DEADLINE=560
AB_VARIANTS="sttma=.gpu/fp4moe stcp1=.gpu/fp4moe@FP4MOE_PREFILL_FEED=cp:auto" AB_TOKENS=1024,4096 AB_BENCH_ARGS=--stages \
  bash scripts/gpu-ab.sh 2>&1 | tail -6
grep -h "stages\|^ *[0-9]* routing" /tmp/res/ab-st*.txt
