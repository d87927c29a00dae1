#!/usr/bin/env bash
# Session 48 call 6 (run 224): where the dual GEMM2's time goes at 16384 tokens (Nemotron), whose
# epilogue run 219 priced at 29 % (1745 -> 1233 µs without it) and whose blocks' phases are not
# the cause (run 223: staggering each SM's two blocks changed nothing): ncu stall ratios and the
# per-SASS-instruction warp samples (source page) of prefill_dual_gemm2, main's kernels.
mkdir -p /tmp/fp4moe-cache; cp .gpu/kc/* /tmp/fp4moe-cache/
SASS_KERNELS="16384:prefill_dual_gemm2" STALL_KERNELS="16384:prefill_dual_gemm2" bash scripts/gpu-run.sh stalls sass
