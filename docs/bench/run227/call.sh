#!/usr/bin/env bash
# Session 49 call 2 (run 227): every GPU test on the build with the bare-read yardstick (53140b6:
# the layer's forward gains only the yardstick's branch); then the routing path at 2-16 tokens
# re-measured, split against fused (route_small), both forced by FP4MOE_ROUTE, both presets, three
# rounds, the short window: ROUTE_FUSED_MAX_TOKENS = 3 dates from run 138, before the sort
# (sort_pairs_few, run 191) and top-k (TOPK_LEAN, run 195) work that both paths share.
export AB_TESTS=1 AB_ROUNDS=3 AB_TOKENS=2,3,4,5,6,8,12,16 AB_DEADLINE=470 AB_TEST_TIMEOUT=300
export AB_VARIANTS="split=.gpu/fp4moe@FP4MOE_ROUTE=split fused=.gpu/fp4moe@FP4MOE_ROUTE=fused"
bash scripts/gpu-ab.sh 2>&1 | tail -30
mkdir -p "${OUT:-/tmp/out}" && tar czf "${OUT:-/tmp/out}/res.tgz" -C /tmp/res .
