#!/usr/bin/env bash
# Session 47 call 1 (run 214): the bf16 router's 64-token tile on 16 warps of four n8 tiles (new,
# a8697cd: two 512-thread blocks per SM, 32 warps, against 2 x 8 before) and its 16-token tile
# on 8 warps (t16w8, wip/t16w8: two n8 tiles per warp, 256-thread blocks): the router tests,
# prefill, token-order and graph tests of both builds, moe_golden, moe_random; A/B base
# (dbb029e) / new / t16w8 at 128-16384 tokens, both presets, two rounds; stages of base / new at
# 1024 / 4096 / 16384 and base / t16w8 at 256 / 512 tokens (Nemotron, sustained); ncu of the new
# router at 4096 tokens.
cp .gpu/alt-t16w8/cuda_device-* .gpu/tests/cuda_device_alt-t16w8 2>/dev/null || true
# The alt builds share every CUBIN but routing's with the new one (deduplicated when staged).
for d in .gpu/alt-*/kc; do cp -n .gpu/kc/* "$d"/; done
export AB_TESTS=1 AB_ROUNDS=2 AB_TOKENS=128,256,512,1024,2048,4096,16384 AB_DEADLINE=300 AB_TEST_TIMEOUT=240
export AB_TEST_FILTER="router prefill outputs_do_not graph_capture"
export AB_VARIANTS="base=.gpu/alt-dbb029e/fp4moe new=.gpu/fp4moe t16w8=.gpu/alt-t16w8/fp4moe"
bash scripts/gpu-ab.sh 2>&1 | tail -40
export AB_TESTS=0 AB_ROUNDS=1 AB_DEADLINE=480 AB_PRESETS=nemotron3-nano
AB_VARIANTS="stbase=.gpu/alt-dbb029e/fp4moe stnew=.gpu/fp4moe" AB_TOKENS=1024,4096,16384 AB_BENCH_ARGS=--stages \
  AB_SETTLE_MS=1500 AB_MIN_TIME_MS=500 bash scripts/gpu-ab.sh 2>&1 | tail -4
AB_VARIANTS="stb16=.gpu/alt-dbb029e/fp4moe stw8=.gpu/alt-t16w8/fp4moe" AB_TOKENS=256,512 AB_BENCH_ARGS=--stages \
  AB_SETTLE_MS=1500 AB_MIN_TIME_MS=500 bash scripts/gpu-ab.sh 2>&1 | tail -4
grep -h "stages\|^ *[0-9]* routing\|routing" /tmp/res/ab-st*.txt | head -40
R=/tmp/res; KC=/tmp/kcn; mkdir -p $KC; cp .gpu/kc/* $KC/ 2>/dev/null
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
timeout 80 env FP4MOE_CACHE_DIR=$KC $NCU --cache-control none --clock-control none --kernel-name router_logits_bf16 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
  .gpu/fp4moe bench --preset nemotron3-nano --tokens 4096 --settle-ms 0 --min-time-ms 0 --warmup-ms 0 --iterations 1 --inputs 1 > $R/ncu-router-new.txt 2>&1
grep -E "Duration|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Registers Per|Block Limit" $R/ncu-router-new.txt | head -16
tar czf "$OUT/res.tgz" -C /tmp res
