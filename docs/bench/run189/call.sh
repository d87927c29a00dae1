#!/usr/bin/env bash
# Session 42 call 3 (run 189): where the routing chain's time goes, by graph prefixes of the
# launch sequence (docs/experiments/launch-cut.patch: FP4MOE_LAUNCH_CUT=n keeps each forward's
# first n launches); W4A16, 8 / 64 / 256 tokens, both presets, two rounds; the whole layer with
# --stages once per preset.
R=/tmp/res; mkdir -p $R
export FP4MOE_CACHE_DIR=/tmp/kc; mkdir -p $FP4MOE_CACHE_DIR; cp .gpu/kc/* $FP4MOE_CACHE_DIR/
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > $R/gpu.txt
.gpu/fp4moe compile-kernels --arch sm_90a > $R/compile.txt 2>&1
for p in nemotron3-nano qwen3-30b-a3b; do
  timeout 120 .gpu/fp4moe bench --preset $p --tokens 8,64,256 --stages > $R/stages-$p.txt 2>&1
done
for r in 1 2; do for cut in 1 2 3 4 5 6 7 8 9; do for p in nemotron3-nano qwen3-30b-a3b; do
  timeout 60 env FP4MOE_LAUNCH_CUT=$cut .gpu/fp4moe bench --preset $p --tokens 8,64,256 > $R/cut$cut-$p-r$r.txt 2> $R/cut$cut-$p-r$r.err
done; done; echo "round $r done $SECONDS" >> $R/progress.txt; done
tar czf "$OUT/res.tgz" -C /tmp res
