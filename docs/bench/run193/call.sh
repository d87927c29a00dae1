#!/usr/bin/env bash
# Session 43 call 3 (run 193): the documentation sweep of final main (sort_pairs_few, run 191's
# code): fp4moe bench over 1-16384 tokens, both presets, W4A16 and W4A4, then the PyTorch bf16
# peer (benches/peers/torch_moe.py) in the same call. No tests (run 191 ran them on this code).
export AB_TESTS=0 AB_ROUNDS=0 AB_SWEEP=1 AB_TORCH=1 AB_DEADLINE=300
bash scripts/gpu-ab.sh
grep -h "^ *[0-9]" /tmp/res/*-w4a16.txt /tmp/res/*-w4a4.txt | head -40
# Then, warm (repeat/): three rounds of fp4moe bench --tokens 1,8,64 per preset (W4A16):
#   for r in 1 2 3; do for p in nemotron3-nano qwen3-30b-a3b; do
#     FP4MOE_CACHE_DIR=$KC .gpu/fp4moe bench --preset $p --tokens 1,8,64 --json $OUT/r/$p-r$r.json; done; done
# (the device returned rounds 1-3 of Nemotron and round 1 of Qwen3 as files, the other Qwen3
# rounds only in its printed tail: 8 tokens 57.3 / 57.3 us, 64 113.3 / 113.4, 1 29.4 / 29.7)
