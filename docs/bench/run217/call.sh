#!/usr/bin/env bash
# Session 47 call 4 (run 217): main at 8c875a4 (runs 214-215's router: the bits-based exactness
# test, the 16-token tile on 8 warps): every GPU test (cuda_device whole, moe_golden,
# moe_random), then the documentation sweep (both presets and modes, sustained timing) and the
# PyTorch peer.
export AB_TESTS=1 AB_ROUNDS=0 AB_SWEEP=1 AB_TORCH=1 AB_DEADLINE=520 AB_TEST_TIMEOUT=280
export AB_VARIANTS="main=.gpu/fp4moe"
bash scripts/gpu-ab.sh 2>&1 | tail -12
grep -h "^ *[0-9]" /tmp/res/nemotron3-nano-w4a16.txt /tmp/res/qwen3-30b-a3b-w4a16.txt | head -40
