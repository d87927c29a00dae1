#!/usr/bin/env bash
# Session 42 call 4 (run 190): the block pair sort with a pair per thread up to 1024 pairs
# (sort_pairs_small; FP4MOE_DEFINES=SORT_SMALL=0 keeps the general block sort): every GPU test;
# memcheck and racecheck on the grouping test; on / off at 2-160 tokens, both presets, three
# rounds; then Nemotron --stages at 6-10 tokens (GEMM1's waves) and the launch prefixes at 8 / 64
# tokens (FP4MOE_LAUNCH_CUT, launch-cut.patch) with the new sort.
export AB_TESTS=1 AB_ROUNDS=3 AB_TOKENS=2,8,16,32,64,96,128,160 AB_DEADLINE=320 AB_TEST_TIMEOUT=280
export AB_SANITIZER="memcheck racecheck,--racecheck-report=hazard" AB_SANITIZER_FILTER="grouping_orders" AB_SANITIZER_TIMEOUT=200
export AB_VARIANTS="new=.gpu/fp4moe off=.gpu/fp4moe@FP4MOE_DEFINES=SORT_SMALL=0"
bash scripts/gpu-ab.sh
KC=/tmp/kc-$(echo .gpu/fp4moe | md5sum | cut -c1-8)
timeout 40 env FP4MOE_CACHE_DIR=$KC .gpu/fp4moe bench --preset nemotron3-nano --tokens 6,7,8,9,10 --stages > /tmp/res/stages-n6-10.txt 2>&1
for cut in 2 3 4; do for p in nemotron3-nano qwen3-30b-a3b; do
  timeout 30 env FP4MOE_CACHE_DIR=$KC FP4MOE_LAUNCH_CUT=$cut .gpu/fp4moe bench --preset $p --tokens 8,64 > /tmp/res/cut$cut-$p.txt 2>/dev/null
  echo "$p cut $cut: $(grep -h '^ *[0-9]' /tmp/res/cut$cut-$p.txt | awk '{printf "%s:%s ", $1, $2}')"
done; done
tar czf "$OUT/res.tgz" -C /tmp res
grep -h "test result\|panicked\|SUMMARY" /tmp/res/test-*.txt /tmp/res/sanitizer-*.txt | head -20
grep -v "^fp4moe" /tmp/res/stages-n6-10.txt
