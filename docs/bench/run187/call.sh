#!/usr/bin/env bash
# Session 42 call 1 (run 187): fused-combine-v2 (the combine fused into the decode GEMM2, one
# acq_rel ticket warp, 16-byte sums): every GPU test with it on by default; memcheck and
# racecheck on its test; fused / combine kernel at 2-96 tokens, both presets, three rounds
# W4A16, then W4A4 two rounds at 8 and 64.
export AB_TESTS=1 AB_ROUNDS=3 AB_TOKENS=2,4,8,16,32,64,96 AB_DEADLINE=520 AB_TEST_TIMEOUT=300
export AB_SANITIZER="memcheck racecheck,--racecheck-report=hazard" AB_SANITIZER_FILTER="fused_combine" AB_SANITIZER_TIMEOUT=240
export AB_VARIANTS="new=.gpu/fp4moe off=.gpu/fp4moe@FP4MOE_FUSED_COMBINE=0"
bash scripts/gpu-ab.sh
for r in 1 2; do for v in "" "FP4MOE_FUSED_COMBINE=0"; do for p in nemotron3-nano qwen3-30b-a3b; do
  echo "== w4a4 $p ${v:-new} r$r" >> /tmp/res/w4a4.txt
  timeout 60 env FP4MOE_CACHE_DIR=/tmp/kc-$(echo .gpu/fp4moe | md5sum | cut -c1-8) $v .gpu/fp4moe bench --preset $p --mode w4a4 --tokens 8,64 >> /tmp/res/w4a4.txt 2>&1
done; done; done
tar czf "$OUT/res.tgz" -C /tmp res
grep -h "test result\|panicked\|SUMMARY" /tmp/res/test-*.txt /tmp/res/sanitizer-*.txt | head -20
