#!/usr/bin/env bash
# Session 44 call 2 (run 196): main + the lean top-k and bias prefetch (run 195's "new" without
# the two-pair sort, which was reverted): the grouping test (two more general-sort cases);
# the documentation sweep (both presets, both modes) and the PyTorch peer in the same call; then
# KERNEL_NOTES step 20(d): Nemotron 40 and 64 tokens with the workspaces moved by a padding
# allocation (FP4MOE_BENCH_PAD_KB) and their addresses printed, and 40,40,40.
tar xJf .gpu/kc.tar.xz -C .gpu
export AB_TESTS=1 AB_ROUNDS=0 AB_SWEEP=1 AB_TORCH=1 AB_DEADLINE=400 AB_TEST_FILTER="grouping_orders topk_matches"
bash scripts/gpu-ab.sh > /tmp/ab-summary.txt 2>&1
R=/tmp/res; KC=/tmp/kc-$(echo .gpu/fp4moe | md5sum | cut -c1-8)
for r in 1 2; do for t in 40 64; do for pad in 0 64 512 2048 4096 16384 65536; do
  tag=t$t-pad$pad-r$r
  timeout 40 env FP4MOE_CACHE_DIR=$KC FP4MOE_BENCH_PER_GRAPH=1 FP4MOE_BENCH_PAD_KB=$pad .gpu/fp4moe bench --preset nemotron3-nano --tokens $t > $R/place-$tag.txt 2>&1
done; done; done
for r in 1 2; do
  timeout 40 env FP4MOE_CACHE_DIR=$KC FP4MOE_BENCH_PER_GRAPH=1 .gpu/fp4moe bench --preset nemotron3-nano --tokens 40,40,40,64,64,64 > $R/place-rep-r$r.txt 2>&1
done
tar czf "$OUT/res.tgz" -C /tmp res
grep -h "test result\|panicked" $R/test-*.txt
cat $R/progress.txt
for f in $R/*-w4a*.txt; do echo "$(basename $f): $(grep -E '^ +[0-9]+ ' $f | awk '{printf "%s:%s/%s ", $1, $2, $8}')"; done
for f in $R/place-*.txt; do echo "$(basename $f .txt): $(grep -E '^ +[0-9]+ ' $f | awk '{printf "%s:%s ", $1, $2}') $(grep -o 'gemm_ready=0x[0-9a-f]*' $f | tr '\n' ' ')"; done
