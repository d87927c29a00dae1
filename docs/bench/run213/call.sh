#!/usr/bin/env bash
# Session 46 call 6 (run 213): why router_logits_bf16 takes 38.7 µs at 4096 tokens (run 212: 44 MB
# of f32 x in 21 chunks of 32 k per block, 256 blocks) and how close prepare_input_sorted and
# combine are to DRAM bandwidth: ncu SpeedOfLight, memory workload and warp-state sections of
# one launch each, Nemotron W4A16 at 4096 tokens.
R=/tmp/res; mkdir -p $R; KC=/tmp/kc; mkdir -p $KC; cp .gpu/kc/* $KC/
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
B="--settle-ms 0 --min-time-ms 0 --warmup-ms 0 --iterations 1 --inputs 1"
for k in router_logits_bf16 prepare_input_sorted combine; do
  timeout 80 env FP4MOE_CACHE_DIR=$KC $NCU --cache-control none --clock-control none --kernel-name $k --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats --section Occupancy \
    .gpu/fp4moe bench --preset nemotron3-nano --tokens 4096 $B > $R/ncu-$k.txt 2>&1
done
tar czf "$OUT/res.tgz" -C /tmp res
for k in router_logits_bf16 prepare_input_sorted combine; do echo "== $k"; grep -E "Duration|DRAM Throughput|Memory Throughput|L2 Cache Throughput|Compute \(SM\)|Achieved Occupancy|Stall|Warp Cycles Per Issued|Registers Per|Shared Memory Config|Block Limit" $R/ncu-$k.txt | head -24; done
