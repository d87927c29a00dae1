#!/usr/bin/env bash
# Session 49 call 4 (run 229): the extra cost of the read after routing comes with GEMM1's sorted
# input copy (run 228)? A/B at 128 / 256 / 512 tokens, the layer with --stages --bare-reads,
# both presets, two rounds, the short window: base (53140b6 + the define below, off); cp
# (FP4MOE_PREFILL_FEED=cp:tma: GEMM1 fed by cp.async, no sorted copy); cs (the sorted copy by
# streaming stores, FP4MOE_DEFINES=PREP_SORTED_STREAM=1). First cuda_device's prefill, graph and
# yardstick tests under the cs define.
export AB_TESTS=1 AB_TEST_FILTER="prefill graph_capture bare_read" AB_TEST_ENV="FP4MOE_DEFINES=PREP_SORTED_STREAM=1"
export AB_ROUNDS=2 AB_TOKENS=128,256,512 AB_DEADLINE=470 AB_TEST_TIMEOUT=200
export AB_BENCH_ARGS="--stages --bare-reads"
export AB_VARIANTS="base=.gpu/fp4moe cp=.gpu/fp4moe@FP4MOE_PREFILL_FEED=cp:tma cs=.gpu/fp4moe@FP4MOE_DEFINES=PREP_SORTED_STREAM=1"
bash scripts/gpu-ab.sh 2>&1 | tail -16
mkdir -p "${OUT:-/tmp/out}" && tar czf "${OUT:-/tmp/out}/res.tgz" -C /tmp/res .
