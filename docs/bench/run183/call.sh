#!/usr/bin/env bash
# Session 41 call 1 (run 183): KERNEL_NOTES step 17(b), no code: the gated half kernel at 4 blocks
# per SM (GATED_HALF_BLOCKS=4, a define of 3cdf854), and at 3 k groups in flight, against the
# default, Qwen3 3-32 tokens; stages at 8 / 64 / 256 tokens. Staged with
# STAGE_DEFINES="GATED_HALF_BLOCKS=4 DECODE_GATED_WIDE_DEPTH=3" scripts/stage-kernels.sh.
export AB_TESTS=0 AB_ROUNDS=2 AB_PRESETS=qwen3-30b-a3b AB_TOKENS=3,4,5,6,8,12,16,24,32 AB_DEADLINE=400
export AB_VARIANTS="new=.gpu/fp4moe h3=.gpu/fp4moe@FP4MOE_GEMM_SHAPE=half:auto h4=.gpu/fp4moe@FP4MOE_DEFINES=GATED_HALF_BLOCKS=4,FP4MOE_GEMM_SHAPE=half:auto d3=.gpu/fp4moe@FP4MOE_DEFINES=DECODE_GATED_WIDE_DEPTH=3,FP4MOE_GEMM_SHAPE=half:auto"
bash scripts/gpu-ab.sh
kc=/tmp/kc-$(echo .gpu/fp4moe | md5sum | cut -c1-8)
for p in nemotron3-nano qwen3-30b-a3b; do
  FP4MOE_CACHE_DIR=$kc timeout 60 .gpu/fp4moe bench --preset $p --tokens 8,64,256 --stages > /tmp/res/stages-$p.txt 2>&1
done
tar czf "$OUT/res.tgz" -C /tmp res
