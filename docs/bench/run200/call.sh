#!/usr/bin/env bash
# Session 44 call 6 (run 200): KERNEL_NOTES step 21(c): where the routing chain's ~25 us at 256
# tokens go (run 189's graph cut: the one-block sort adds 8.2 us there). ncu per-kernel duration,
# active cycles and instructions of every routing kernel, Nemotron W4A16 at 256 and 8 tokens,
# Qwen3 at 256 (one forward after one eager forward; short bench timing), caches not flushed.
tar xJf .gpu/kc.tar.xz -C .gpu
R=/tmp/res; mkdir -p $R; KC=/tmp/kc; mkdir -p $KC; cp .gpu/kc/* $KC/
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
B="--settle-ms 0 --min-time-ms 0 --warmup-ms 0 --iterations 1 --inputs 1"
for c in "nemotron3-nano 256" "qwen3-30b-a3b 256" "nemotron3-nano 8"; do set -- $c
  timeout 100 env FP4MOE_CACHE_DIR=$KC $NCU --cache-control none --clock-control none \
    --kernel-name regex:"router|route_topk|sort_pairs|invert_pairs|prepare_input" --launch-skip 6 --launch-count 12 \
    --metrics gpu__time_duration.sum,sm__cycles_active.max,smsp__inst_executed.sum,launch__grid_size,launch__block_size \
    .gpu/fp4moe bench --preset $1 --tokens $2 $B > $R/ncu-$1-$2.txt 2>&1
done
timeout 60 env FP4MOE_CACHE_DIR=$KC $NCU --cache-control none --kernel-name sort_pairs --launch-skip 1 --launch-count 1 \
  --sampling-interval 0 --section SourceCounters --section WarpStateStats --page source --print-source sass \
  .gpu/fp4moe bench --preset nemotron3-nano --tokens 256 $B > $R/ncu-src-sort-256.txt 2>&1
tar czf "$OUT/res.tgz" -C /tmp res
for f in $R/ncu-*-*.txt; do echo "== $(basename $f)"; grep -E '^  [a-z_0-9]+.*\(|gpu__time_duration|sm__cycles_active|inst_executed' $f | head -60; done
