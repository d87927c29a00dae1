#!/usr/bin/env bash
# Session 41 call 4 (run 186): the combine fused into the decode GEMM2; the GPU tests that touch
# the GEMM parameters' new fields, memcheck on the new test; fused / combine kernel at 2-64
# tokens, both presets.
export AB_TESTS=1 AB_ROUNDS=2 AB_TOKENS=2,8,64 AB_DEADLINE=240 AB_TEST_TIMEOUT=200
export AB_TEST_FILTER="fused_combine one_token prefill_golden graph_capture repeated_expert"
export AB_SANITIZER="memcheck" AB_SANITIZER_FILTER="fused_combine" AB_SANITIZER_TIMEOUT=200
export AB_VARIANTS="new=.gpu/fp4moe off=.gpu/fp4moe@FP4MOE_FUSED_COMBINE=0"
bash scripts/gpu-ab.sh
tar czf "$OUT/res.tgz" -C /tmp res
grep -h "test result\|panicked\|SUMMARY" /tmp/res/test-*.txt /tmp/res/sanitizer-*.txt | head
