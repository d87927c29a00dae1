#!/usr/bin/env bash
# Session 44 call 8 (run 202): the block and chunked pair sorts read each warp's ids once, all
# rounds at once, before the first barrier (SORT_IDS_ONCE; =0: round by round, as before), after
# run 201's source view put 68 % of the 1536-pair sort's samples on those loads. The sort tests
# (grouping, the large-batch prefill, token order, repeated experts, the fused-vs-split bits);
# A/B at 256 / 512 / 1024 tokens (Nemotron 1536 / 3072 / 6144 pairs: block, block, chunked;
# Qwen3 2048 / 4096 / 8192), both presets, three rounds, the short window.
tar xJf .gpu/kc.tar.xz -C .gpu
export AB_TESTS=1 AB_ROUNDS=3 AB_TOKENS=256,512,1024 AB_DEADLINE=200 AB_TEST_TIMEOUT=150
export AB_TEST_FILTER="grouping_orders prefill_nemotron_shape_large_batches outputs_do_not_depend repeated_expert fused_routing"
export AB_VARIANTS="new=.gpu/fp4moe old=.gpu/fp4moe@FP4MOE_DEFINES=SORT_IDS_ONCE=0"
bash scripts/gpu-ab.sh 2>&1 | tail -20
