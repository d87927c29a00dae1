#!/usr/bin/env bash
# Session 47 call 5 (run 218): compute-sanitizer memcheck and racecheck (hazard report) on the
# changed router kernels at 8c875a4: cuda_device's router_logits_bf16_keep_every_bit_of_x (300
# tokens: the 16-token tile on 8 warps; 1100: the 64-token tile; every x inexact, so both the
# bit-test path and the rounding path run); then again on both router_logits_bf16 tests
# (adding router_logits_bf16_match_the_cpu: 100-8500 tokens), whose logs are these: the same
# script with AB_SANITIZER_FILTER="router_logits_bf16" AB_SANITIZER_TIMEOUT=150 (racecheck 90 s).
export AB_TESTS=0 AB_ROUNDS=0 AB_SANITIZER="memcheck racecheck,--racecheck-report=hazard"
export AB_SANITIZER_FILTER="router_logits_bf16_keep" AB_SANITIZER_TIMEOUT=170 AB_VARIANTS="main=.gpu/fp4moe"
bash scripts/gpu-ab.sh 2>&1 | tail -6
