#!/usr/bin/env bash
# Session 44 call 3 (run 197): KERNEL_NOTES step 20(d), after run 196 showed the third timed
# size of a process ~10 us slower at the same workspace addresses (and no padding offset moving
# a lone size): Nemotron `--tokens 40,40,40,40,40,40` with every replay's time in launch order
# (FP4MOE_BENCH_PER_GRAPH=raw) and nvidia-smi sampling clocks, power and throttle reasons every
# 50 ms beside it; then with 16 extra graphs instantiated per timed size
# (FP4MOE_BENCH_EXTRA_GRAPHS), and with CUDA_DEVICE_MAX_CONNECTIONS=1 / 32 (default 8).
tar xJf .gpu/kc.tar.xz -C .gpu
R=/tmp/res; mkdir -p $R; KC=/tmp/kc; mkdir -p $KC; cp .gpu/kc/* $KC/
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > $R/gpu.txt
L="40,40,40,40,40,40"
run() { # tag env...
  local tag=$1; shift
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv,noheader -lms 50 > $R/smi-$tag.csv 2>&1 &
  local smi=$!
  date +%s.%N > $R/t-$tag.txt
  timeout 60 env FP4MOE_CACHE_DIR=$KC "$@" .gpu/fp4moe bench --preset nemotron3-nano --tokens $L > $R/rep-$tag.txt 2>&1
  date +%s.%N >> $R/t-$tag.txt
  kill $smi
}
for r in 1 2; do
  run raw-r$r FP4MOE_BENCH_PER_GRAPH=raw
  run x16-r$r FP4MOE_BENCH_EXTRA_GRAPHS=16
  run c1-r$r CUDA_DEVICE_MAX_CONNECTIONS=1
  run c32-r$r CUDA_DEVICE_MAX_CONNECTIONS=32
done
tar czf "$OUT/res.tgz" -C /tmp res
for f in $R/rep-*.txt; do echo "$(basename $f .txt): $(grep -E '^ +[0-9]+ ' $f | awk '{printf "%s ", $2}')"; done
for f in $R/smi-raw-r1.csv; do awk -F, '{print $2, $4, $6}' $f | sort | uniq -c | sort -rn | head -8; done
