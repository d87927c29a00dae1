#!/usr/bin/env bash
# Session 48 call 4 (run 222): main at 69fc64c (the kernels of run 217, which ran every GPU test
# on them): the documentation sweep (both presets and modes, sustained timing), the PyTorch peer
# and the yardsticks (benches/peers/yardsticks.py), one call on one machine.
export AB_TESTS=0 AB_ROUNDS=0 AB_SWEEP=1 AB_TORCH=1 AB_YARDSTICKS=1 AB_DEADLINE=480
export AB_VARIANTS="main=.gpu/fp4moe"
bash scripts/gpu-ab.sh 2>&1 | tail -12
grep -h "^ *[0-9]" /tmp/res/nemotron3-nano-w4a16.txt /tmp/res/qwen3-30b-a3b-w4a16.txt | head -40
cat /tmp/res/yardsticks-*.txt
