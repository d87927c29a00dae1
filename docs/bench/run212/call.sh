#!/usr/bin/env bash
# Session 46 call 5 (run 212): where the prefill layer's routing and combine time goes (run 208's
# stages: routing 111 µs at 4096 tokens, 343 at 16384): ncu per-kernel duration, grid and
# instructions of every kernel of one eager forward, Nemotron W4A16 at 4096 and 16384 tokens,
# Qwen3 at 4096 (serialized by ncu, caches not flushed, clocks not locked).
R=/tmp/res; mkdir -p $R; KC=/tmp/kc; mkdir -p $KC; cp .gpu/kc/* $KC/
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
B="--settle-ms 0 --min-time-ms 0 --warmup-ms 0 --iterations 1 --inputs 1"
for c in "nemotron3-nano 4096" "nemotron3-nano 16384" "qwen3-30b-a3b 4096"; do set -- $c
  timeout 150 env FP4MOE_CACHE_DIR=$KC $NCU --cache-control none --clock-control none --launch-count 24 \
    --metrics gpu__time_duration.sum,smsp__inst_executed.sum,launch__grid_size,launch__block_size,dram__bytes.sum \
    .gpu/fp4moe bench --preset $1 --tokens $2 $B > $R/ncu-$1-$2.txt 2>&1
done
tar czf "$OUT/res.tgz" -C /tmp res
for f in $R/ncu-*-*.txt; do echo "== $(basename $f)"; grep -E '^  [a-zA-Z_0-9]+.*\(|gpu__time_duration' $f | paste - - | awk '{print $1, $(NF)}' | head -30; done
