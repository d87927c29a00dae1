#!/usr/bin/env bash
# Session 45 call 4 (run 206): the final code (the half-computing 32-token tiles of run 203,
# without run 203's idle-warpgroup branch): every GPU test; a timing-only ablation (alt-ablate:
# every NVFP4 fragment's conversion replaced by the raw words, 4 operations instead of ~14;
# results meaningless, the loads, MMAs and pipeline kept; its gated decode kernels spill, so
# only the non-gated layer's decode sizes are clean) against the final build at 1-4096 tokens,
# both presets, two rounds, the short window; then the documentation sweep (sustained clock)
# and the PyTorch peer.
export AB_TESTS=1 AB_ROUNDS=2 AB_TOKENS=1,8,64,256,1024,4096 AB_DEADLINE=520 AB_TEST_TIMEOUT=300
export AB_SWEEP=1 AB_TORCH=1
export AB_VARIANTS="new=.gpu/fp4moe ablate=.gpu/alt-ablate/fp4moe"
bash scripts/gpu-ab.sh 2>&1 | tail -45
