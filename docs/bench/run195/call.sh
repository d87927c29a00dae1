#!/usr/bin/env bash
# Session 44 call 1 (run 195): the lean register top-k (TOPK_LEAN), route_topk's bias prefetch
# before its wait (TOPK_BIAS_PREFETCH) and sort_pairs_few with two pairs per thread up to 2048
# pairs (SORT_FEW=2): every GPU test (full cuda_device, moe_golden, moe_random), memcheck and
# racecheck on the grouping test; A/B at 1-256 tokens, both presets, three rounds: new (all on),
# old (all three off: session 43's kernels), and each piece off alone. Then KERNEL_NOTES step
# 20(d): one size (Nemotron 40 tokens) in several token lists, with per-graph medians and clocks.
# (Staged with STAGE_DEFINES for the four define sets; .gpu/kc shipped as kc.tar.xz, 1.5 MB,
# where the directory was 62 MB: the carry limit is 64 MiB.)
tar xJf .gpu/kc.tar.xz -C .gpu
export AB_TESTS=1 AB_ROUNDS=3 AB_TOKENS=1,2,8,16,64,256 AB_DEADLINE=430 AB_TEST_TIMEOUT=300
export AB_SANITIZER="memcheck racecheck,--racecheck-report=hazard" AB_SANITIZER_FILTER="grouping_orders" AB_SANITIZER_TIMEOUT=240
export AB_VARIANTS="new=.gpu/fp4moe old=.gpu/fp4moe@FP4MOE_DEFINES=TOPK_LEAN=0+TOPK_BIAS_PREFETCH=0+SORT_FEW=1 nolean=.gpu/fp4moe@FP4MOE_DEFINES=TOPK_LEAN=0 nopf=.gpu/fp4moe@FP4MOE_DEFINES=TOPK_BIAS_PREFETCH=0 sort1=.gpu/fp4moe@FP4MOE_DEFINES=SORT_FEW=1"
bash scripts/gpu-ab.sh > /tmp/ab-summary.txt 2>&1
R=/tmp/res; KC=/tmp/kc-$(echo .gpu/fp4moe | md5sum | cut -c1-8)
for r in 1 2; do for list in 40 24,32,40 36,40,44,48 40,40,40 40,24,32,40; do
  tag=$(echo $list | tr , _)-r$r
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader > $R/list-$tag.clk
  timeout 40 env FP4MOE_CACHE_DIR=$KC FP4MOE_BENCH_PER_GRAPH=1 .gpu/fp4moe bench --preset nemotron3-nano --tokens $list > $R/list-$tag.txt 2>&1
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader >> $R/list-$tag.clk
done; done
tar czf "$OUT/res.tgz" -C /tmp res
cat /tmp/ab-summary.txt | tail -45
for f in $R/list-*.txt; do echo "$(basename $f): $(grep -E '^ +[0-9]+ ' $f | awk '{printf "%s:%s ", $1, $2}')"; done
