#!/usr/bin/env bash
# Session 44 call 4 (run 198): the bench's new timing (--settle-ms 1500: the first sizes' warm-up
# lasts until 1.5 s of GPU time in all; --min-time-ms 1000: each size timed over >= 1 s of
# replays; the PyTorch peer the same), after run 197 put the third and sixth sizes of a token
# list into the power controller's clock dips. Nemotron `--tokens 40,40,40,40,40,40` twice with
# nvidia-smi sampling beside it; the CLI and golden tests; the documentation sweep (both presets,
# both modes) and the PyTorch peer in the same call.
tar xJf .gpu/kc.tar.xz -C .gpu
R=/tmp/res; mkdir -p $R; KC=/tmp/kc-$(echo .gpu/fp4moe | md5sum | cut -c1-8); mkdir -p $KC; cp .gpu/kc/* $KC/
for r in 1 2; do
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv,noheader -lms 50 > $R/smi-rep-r$r.csv 2>&1 &
  smi=$!
  timeout 90 env FP4MOE_CACHE_DIR=$KC FP4MOE_BENCH_PER_GRAPH=1 .gpu/fp4moe bench --preset nemotron3-nano --tokens 40,40,40,40,40,40 > $R/rep-r$r.txt 2>&1
  kill $smi
done
export AB_TESTS=1 AB_ROUNDS=0 AB_SWEEP=1 AB_TORCH=1 AB_DEADLINE=400
bash scripts/gpu-ab.sh > /tmp/ab-summary.txt 2>&1
tar czf "$OUT/res.tgz" -C /tmp res
grep -h "test result\|panicked" $R/test-*.txt
cat $R/progress.txt
for f in $R/rep-*.txt; do echo "$(basename $f .txt): $(grep -E '^ +[0-9]+ ' $f | awk '{printf "%s ", $2}')"; done
for f in $R/*-w4a*.txt; do echo "$(basename $f): $(grep -E '^ +[0-9]+ ' $f | awk '{printf "%s:%s/%s ", $1, $2, $8}')"; done
for f in $R/torch-*.txt; do echo "$(basename $f): $(grep -E '^ +[0-9]+ ' $f | awk '{printf "%s:%s ", $1, $2}')"; done
