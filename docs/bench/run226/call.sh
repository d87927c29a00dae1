#!/usr/bin/env bash
# Session 49 call 1 (run 226): the bare-read yardstick (`bare_read.cu`, `fp4moe bench
# --bare-reads`): its GPU test, then Nemotron and Qwen3 W4A16 at 1 / 8 / 64 / 256 tokens with
# --stages and --bare-reads (sustained timing), both presets twice (two machines' worth of
# spread is not available: two rounds on this one).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export FP4MOE_REQUIRE_GPU=1 FP4MOE_GOLDEN_DIR="$PWD/.gpu/golden" RUST_BACKTRACE=1
rm -rf /tmp/kc && cp -r .gpu/kc /tmp/kc && export FP4MOE_CACHE_DIR=/tmp/kc
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw --format=csv,noheader | tee "$OUT/gpu.txt"
t=$(ls .gpu/tests/cuda_device-* | head -1)
timeout 240 "$t" --test-threads=1 bare_read graph_capture 2>&1 | tail -8 | tee "$OUT/test-cuda_device.txt"
for r in 1 2; do
  for p in nemotron3-nano qwen3-30b-a3b; do
    timeout 200 .gpu/fp4moe bench --preset $p --tokens 1,8,64,256 --stages --bare-reads \
      --json "$OUT/$p-r$r.json" > "$OUT/$p-r$r.txt" 2>/dev/null
    grep -v "^fp4moe\|^tokens" "$OUT/$p-r$r.txt"
  done
done
