#!/usr/bin/env bash
# Session 46 call 4 (run 211): non-gated 8-slot prefill tiles (dual, wide) whose rows end within
# their first half split the token columns over both warpgroups on that half's slots
# (PF_SPLIT_TILES; Nemotron GEMM1's last row tile: 4 of 8 row groups): cuda_device's prefill,
# token-order, graph and deep-decode tests (every tile bitwise, I 1856 and H 2880 included),
# moe_golden, moe_random; A/B of one binary, split on / off (FP4MOE_DEFINES=PF_SPLIT_TILES=0),
# Nemotron 1024-16384 tokens, three rounds, the short window; then the documentation sweep
# (both presets and modes, sustained) and the PyTorch peer.
export AB_TESTS=1 AB_ROUNDS=3 AB_TOKENS=1024,2048,4096,8192,16384 AB_PRESETS=nemotron3-nano AB_DEADLINE=420 AB_TEST_TIMEOUT=300
export AB_TEST_FILTER="prefill outputs_do_not graph_capture deep_decode"
export AB_SWEEP=1 AB_TORCH=1
export AB_VARIANTS="on=.gpu/fp4moe off=.gpu/fp4moe@FP4MOE_DEFINES=PF_SPLIT_TILES=0"
bash scripts/gpu-ab.sh 2>&1 | tail -30
