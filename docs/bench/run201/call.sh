#!/usr/bin/env bash
# Session 44 call 7 (run 201): run 200's source view, with ncu's option spelled right: the
# general one-block sort at Nemotron 256 tokens (1536 pairs), warp samples per SASS instruction.
tar xJf .gpu/kc.tar.xz -C .gpu
R=/tmp/res; mkdir -p $R; KC=/tmp/kc; mkdir -p $KC; cp .gpu/kc/* $KC/
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
B="--settle-ms 0 --min-time-ms 0 --warmup-ms 0 --iterations 1 --inputs 1"
timeout 90 env FP4MOE_CACHE_DIR=$KC $NCU --cache-control none --kernel-name sort_pairs --launch-skip 1 --launch-count 1 \
  --warp-sampling-interval 0 --section SourceCounters --section WarpStateStats --page source --print-source sass \
  .gpu/fp4moe bench --preset nemotron3-nano --tokens 256 $B > $R/ncu-src-sort-256.txt 2>&1
tar czf "$OUT/res.tgz" -C /tmp res
wc -l $R/ncu-src-sort-256.txt; grep -c BAR $R/ncu-src-sort-256.txt
