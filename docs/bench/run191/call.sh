#!/usr/bin/env bash
# Session 43 call 1 (run 191): sort_pairs_few (the one-block pair sort for <= 1024 pairs in four
# phases, no serial warp-0 sections; FP4MOE_DEFINES=SORT_FEW=0 keeps the general block sort):
# every GPU test (with session 42's token-order test, never run before), memcheck and racecheck
# on the grouping test; on / off at 2-160 tokens, both presets, three rounds; then ncu on the
# sort (new / old, 8 / 64 tokens; the new one's per-instruction source view at 64) and
# Nemotron --stages at 7-9 tokens with GEMM1 auto / half / wide (KERNEL_NOTES step 19(a)).
export AB_TESTS=1 AB_ROUNDS=3 AB_TOKENS=2,8,16,32,64,96,128,160 AB_DEADLINE=330 AB_TEST_TIMEOUT=280
export AB_SANITIZER="memcheck racecheck,--racecheck-report=hazard" AB_SANITIZER_FILTER="grouping_orders" AB_SANITIZER_TIMEOUT=200
export AB_VARIANTS="new=.gpu/fp4moe off=.gpu/fp4moe@FP4MOE_DEFINES=SORT_FEW=0"
bash scripts/gpu-ab.sh
R=/tmp/res; KC=/tmp/kc-$(echo .gpu/fp4moe | md5sum | cut -c1-8)
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
for d in 1 0; do for t in 8 64; do
  timeout 45 env FP4MOE_CACHE_DIR=$KC FP4MOE_DEFINES=SORT_FEW=$d $NCU --cache-control none --kernel-name sort_pairs \
    --launch-skip 4 --launch-count 3 --metrics gpu__time_duration.sum,sm__cycles_active.max,smsp__inst_executed.sum \
    .gpu/fp4moe bench --preset nemotron3-nano --tokens $t --inputs 1 > $R/ncu-sort$d-t$t.txt 2>&1
done; done
timeout 60 env FP4MOE_CACHE_DIR=$KC $NCU --cache-control none --kernel-name sort_pairs --launch-skip 4 --launch-count 1 \
  --section SourceCounters --section WarpStateStats --page source --print-source sass \
  .gpu/fp4moe bench --preset nemotron3-nano --tokens 64 --inputs 1 > $R/ncu-src-t64.txt 2>&1
for shape in auto half:deep wide:deep; do
  timeout 40 env FP4MOE_CACHE_DIR=$KC FP4MOE_GEMM_SHAPE=$shape .gpu/fp4moe bench --preset nemotron3-nano \
    --tokens 7,8,9 --stages > $R/stages-${shape/:/-}.txt 2>&1
done
tar czf "$OUT/res.tgz" -C /tmp res
grep -h "test result\|panicked\|SUMMARY" $R/test-*.txt $R/sanitizer-*.txt | head -20
grep -h "sort_pairs\|gpu__time\|sm__cycles\|inst_executed" $R/ncu-sort*.txt | head -40
grep -hv "^fp4moe" $R/stages-*.txt | head -40
