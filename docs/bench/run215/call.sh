#!/usr/bin/env bash
# Session 47 call 2 (run 215): the bf16 router's exactness test on the bits and its hi from the
# top halves (top, 06aa962: same bits, ~36 fewer instructions per 32-k chunk and warp on
# sm_90a), alone and with the 16-token tile on 8 warps (t16w8, wip/t16w8b): the router,
# prefill, token-order and graph tests of both builds, moe_golden, moe_random; A/B base
# (dbb029e) / top / t16w8 at 128-16384 tokens, both presets, two rounds; stages of base / top
# at 1024 / 4096 / 16384 and base / t16w8 at 256 / 512 (Nemotron, sustained); ncu of top's
# router at 4096 tokens and of t16w8's 16-token router at 512.
cp .gpu/alt-t16w8b/cuda_device-* .gpu/tests/cuda_device_alt-t16w8b 2>/dev/null || true
# The alt builds share every CUBIN but routing's with the new one (deduplicated when staged).
for d in .gpu/alt-*/kc; do cp -n .gpu/kc/* "$d"/ 2>/dev/null; done
export AB_TESTS=1 AB_ROUNDS=2 AB_TOKENS=128,256,512,1024,2048,4096,16384 AB_DEADLINE=300 AB_TEST_TIMEOUT=240
export AB_TEST_FILTER="router prefill outputs_do_not graph_capture"
export AB_VARIANTS="base=.gpu/alt-dbb029e/fp4moe top=.gpu/fp4moe t16w8=.gpu/alt-t16w8b/fp4moe"
bash scripts/gpu-ab.sh 2>&1 | grep -v "^cp:" | tail -20
export AB_TESTS=0 AB_ROUNDS=1 AB_DEADLINE=480 AB_PRESETS=nemotron3-nano
AB_VARIANTS="stbase=.gpu/alt-dbb029e/fp4moe sttop=.gpu/fp4moe" AB_TOKENS=1024,4096,16384 AB_BENCH_ARGS=--stages \
  AB_SETTLE_MS=1500 AB_MIN_TIME_MS=500 bash scripts/gpu-ab.sh > /dev/null 2>&1
AB_VARIANTS="stb16=.gpu/alt-dbb029e/fp4moe stw8=.gpu/alt-t16w8b/fp4moe" AB_TOKENS=256,512 AB_BENCH_ARGS=--stages \
  AB_SETTLE_MS=1500 AB_MIN_TIME_MS=500 bash scripts/gpu-ab.sh > /dev/null 2>&1
for f in /tmp/res/ab-st*.txt; do echo "== $f"; grep -h "routing" $f; done
R=/tmp/res; NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
B="--settle-ms 0 --min-time-ms 0 --warmup-ms 0 --iterations 1 --inputs 1"
for v in "top .gpu/kc .gpu/fp4moe router_logits_bf16 4096" "w8 .gpu/alt-t16w8b/kc .gpu/alt-t16w8b/fp4moe router_logits_bf16_t16 512" \
         "b16 .gpu/alt-dbb029e/kc .gpu/alt-dbb029e/fp4moe router_logits_bf16_t16 512"; do
  set -- $v; KC=/tmp/kc-$1; mkdir -p $KC; cp $2/* $KC/
  timeout 60 env FP4MOE_CACHE_DIR=$KC $NCU --cache-control none --clock-control none --kernel-name regex:"^$4\$" --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
    $3 bench --preset nemotron3-nano --tokens $5 $B > $R/ncu-$1.txt 2>&1
  echo "== ncu $1"; grep -E "Duration|DRAM Throughput|Achieved Occupancy|Warp Cycles Per Issued|Registers Per|Grid Size" $R/ncu-$1.txt | head -8
done
tar czf "$OUT/res.tgz" -C /tmp res
