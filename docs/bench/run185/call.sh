#!/usr/bin/env bash
# Session 41 call 3 (run 185): route_small groups up to 64 pairs in one warp beside the input
# preparation (sort_pairs_warp2); the routing tests with memcheck; fused (new / before) against
# split at 3-16 tokens, both presets.
export AB_TESTS=1 AB_ROUNDS=2 AB_TOKENS=3,4,5,6,8,10,12,16 AB_DEADLINE=420
export AB_TEST_FILTER="fused_routing grouping_orders graph_capture repeated_expert topk_matches one_token"
export AB_SANITIZER="memcheck" AB_SANITIZER_FILTER="fused_routing" AB_SANITIZER_TIMEOUT=240
export AB_VARIANTS="new=.gpu/fp4moe fz=.gpu/fp4moe@FP4MOE_ROUTE=fused fo=.gpu/fp4moe@FP4MOE_ROUTE=fused,FP4MOE_DEFINES=ROUTE_WARP_SORT_MAX_PAIRS=32"
bash scripts/gpu-ab.sh
kc=/tmp/kc-$(echo .gpu/fp4moe | md5sum | cut -c1-8)
for p in nemotron3-nano qwen3-30b-a3b; do
  for r in split fused; do
    FP4MOE_ROUTE=$r FP4MOE_CACHE_DIR=$kc timeout 60 .gpu/fp4moe bench --preset $p --tokens 4,8 --stages > /tmp/res/stages-$r-$p.txt 2>&1
  done
done
tar czf "$OUT/res.tgz" -C /tmp res
tail -3 /tmp/res/test-*.txt /tmp/res/sanitizer-*.txt
