#!/usr/bin/env bash
# Session 49 call 3 (run 228): where the ~10 µs go by which, at 256 tokens, the bare read after
# the layer's routing exceeds routing plus the read alone (run 226). Programmatic launches on
# (default) and off (FP4MOE_PDL=0: every kernel starts after its predecessor ends, none resident
# early) at 8-512 tokens, the layer with --stages and --bare-reads, both presets, two rounds,
# the short window. If early residency is the cost, the layer's GEMM1 (also a programmatic
# dependent of the input copy) pays it too. Binary: run 227's (53140b6; the routing rule of
# 5ecb5c4 moved 3 tokens only).
export AB_TESTS=0 AB_ROUNDS=2 AB_TOKENS=8,64,128,256,512 AB_DEADLINE=470
export AB_BENCH_ARGS="--stages --bare-reads"
export AB_VARIANTS="pdl=.gpu/fp4moe nopdl=.gpu/fp4moe@FP4MOE_PDL=0"
bash scripts/gpu-ab.sh 2>&1 | tail -12
grep -h -A6 "bare reads" /tmp/res/ab-*-r1.txt
mkdir -p "${OUT:-/tmp/out}" && tar czf "${OUT:-/tmp/out}/res.tgz" -C /tmp/res .
