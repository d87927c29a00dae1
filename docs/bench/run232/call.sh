#!/usr/bin/env bash
# Session 49 call 7 (run 232): SORTED_EVICT_LAST (a define): GEMM1's sorted input copy stored
# under an L2 evict-last policy (st.global.L2::cache_hint) and discarded from L2 by each expert's
# last GEMM1 block (discard.global.L2), so its 8.3 MB (256 tokens) are never written back (run
# 229: the write-back costs the reads after it ~7 µs). Tests under the define (cuda_device's
# prefill, graph, token-order and routing-path tests; moe_random), then base / sel at 128 / 256
# / 512 / 1024 tokens with --stages, both presets, two rounds, the short window.
export AB_TESTS=1 AB_TEST_FILTER="prefill graph_capture token_order fused_routing" AB_TEST_ENV="FP4MOE_DEFINES=SORTED_EVICT_LAST=1"
export AB_ROUNDS=2 AB_TOKENS=128,256,512,1024 AB_DEADLINE=330 AB_TEST_TIMEOUT=150
export AB_BENCH_ARGS="--stages"
export AB_VARIANTS="base=.gpu/fp4moe sel=.gpu/fp4moe@FP4MOE_DEFINES=SORTED_EVICT_LAST=1"
bash scripts/gpu-ab.sh 2>&1 | tail -14
mkdir -p "${OUT:-/tmp/out}" && tar czf "${OUT:-/tmp/out}/res.tgz" -C /tmp/res .
