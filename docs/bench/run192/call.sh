#!/usr/bin/env bash
# Session 43 call 2 (run 192): RoutePath::Hybrid (docs/experiments/route-hybrid.patch: the split
# path's router kernels, then one route_small launch from their logits: top-k on up to 32 warps
# and sort_pairs_few in one block, prepare_input beside it) against the default (split from 4
# tokens), FP4MOE_ROUTE=hybrid forcing it: every GPU test (a new bitwise hybrid-vs-split test,
# hybrid in the grouping and graph tests), memcheck and racecheck on the grouping test; A/B at
# 4-64 tokens, both presets, three rounds.
export AB_TESTS=1 AB_ROUNDS=3 AB_TOKENS=4,5,6,8,12,16,24,32,48,64 AB_DEADLINE=420 AB_TEST_TIMEOUT=300
export AB_SANITIZER="memcheck racecheck,--racecheck-report=hazard" AB_SANITIZER_FILTER="grouping_orders" AB_SANITIZER_TIMEOUT=200
export AB_VARIANTS="new=.gpu/fp4moe hyb=.gpu/fp4moe@FP4MOE_ROUTE=hybrid"
bash scripts/gpu-ab.sh
grep -h "test result\|panicked\|SUMMARY\|FAILED" /tmp/res/test-*.txt /tmp/res/sanitizer-*.txt | head -20
