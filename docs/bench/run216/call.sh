#!/usr/bin/env bash
# Session 47 call 3 (run 216): combine and prepare_input with a thread's loads issued as one
# batch before their adds / stores (new: COMBINE_BATCH 8 slots, PREP_BATCH 3 steps; same bits)
# against main before it (base, 8c875a4: run 215's router) and new with the combine's batch of
# 4 (c4: the prep change alone, nearly): every GPU test on new (cuda_device whole, moe_golden,
# moe_random); A/B at 1-16384 tokens, both presets, two rounds; stages of base / new at 1024 /
# 4096 / 16384 (Nemotron, sustained); ncu of new's combine and sorted copy at 4096.
for d in .gpu/alt-*/kc; do cp -n .gpu/kc/* "$d"/ 2>/dev/null; done
export AB_TESTS=1 AB_ROUNDS=2 AB_TOKENS=1,8,64,256,1024,4096,16384 AB_DEADLINE=330 AB_TEST_TIMEOUT=300
export AB_VARIANTS="base=.gpu/alt-8c875a4/fp4moe new=.gpu/fp4moe c4=.gpu/fp4moe@FP4MOE_DEFINES=COMBINE_BATCH=4"
bash scripts/gpu-ab.sh 2>&1 | grep -v "^cp:" | tail -12
export AB_TESTS=0 AB_ROUNDS=1 AB_DEADLINE=480 AB_PRESETS=nemotron3-nano
AB_VARIANTS="stbase=.gpu/alt-8c875a4/fp4moe stnew=.gpu/fp4moe" AB_TOKENS=1024,4096,16384 AB_BENCH_ARGS=--stages \
  AB_SETTLE_MS=1500 AB_MIN_TIME_MS=500 bash scripts/gpu-ab.sh > /dev/null 2>&1
for f in /tmp/res/ab-st*.txt; do echo "== $f"; grep -h "routing" $f; done
R=/tmp/res; NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu); KC=/tmp/kc-new; mkdir -p $KC; cp .gpu/kc/* $KC/
for k in combine prepare_input_sorted; do
  timeout 60 env FP4MOE_CACHE_DIR=$KC $NCU --cache-control none --clock-control none --kernel-name $k --launch-count 1 \
    --section SpeedOfLight --section Occupancy .gpu/fp4moe bench --preset nemotron3-nano --tokens 4096 \
    --settle-ms 0 --min-time-ms 0 --warmup-ms 0 --iterations 1 --inputs 1 > $R/ncu-$k.txt 2>&1
  echo "== ncu $k"; grep -E "Duration|DRAM Throughput|Achieved Occupancy" $R/ncu-$k.txt | head -4
done
tar czf "$OUT/res.tgz" -C /tmp res
