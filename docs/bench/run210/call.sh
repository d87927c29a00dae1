#!/usr/bin/env bash
# Session 46 call 3 (run 210): the final build (main 1dee945: the half tail of the deep decode
# blocks, the per-GEMM feed knob): every GPU test; A/B of one binary, the tail on / off
# (FP4MOE_DEFINES=DECODE_TAIL_HALF=0), Nemotron 4-64 tokens, three rounds, the short window;
# then the documentation sweep (both presets and modes, sustained timing) and the PyTorch peer.
export AB_TESTS=1 AB_ROUNDS=3 AB_TOKENS=4,6,8,12,16,32,64 AB_PRESETS=nemotron3-nano AB_DEADLINE=470 AB_TEST_TIMEOUT=300
export AB_SWEEP=1 AB_TORCH=1
export AB_VARIANTS="on=.gpu/fp4moe off=.gpu/fp4moe@FP4MOE_DEFINES=DECODE_TAIL_HALF=0"
bash scripts/gpu-ab.sh 2>&1 | tail -30
