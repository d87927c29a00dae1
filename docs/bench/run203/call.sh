#!/usr/bin/env bash
# Session 45 call 1 (run 203): the non-gated 32-token tiles whose row tile ends within its first
# half compute that half only (PF_HALF_TILES; Nemotron-3 Nano's last GEMM1 / GEMM2 row tiles hold
# 4 / 8 of 16 row groups), and on the 8-slot tiles a warpgroup whose four row groups all lie past
# the matrix skips its conversion (PF_IDLE_WG; Nemotron's last GEMM1 row tile, 4 of 8). Tests:
# the prefill tests (every tile bitwise, Nemotron and 2880 / 1856 shapes), the default-path
# sweeps, moe_golden, moe_random. A/B new / each off at 128-4096 tokens, both presets, three
# rounds, the short window.
export AB_TESTS=1 AB_ROUNDS=3 AB_TOKENS=128,256,384,512,704,1024,4096 AB_DEADLINE=420 AB_TEST_TIMEOUT=300
export AB_TEST_FILTER="prefill nemotron_shape_every gated_widths outputs_do_not_depend graph_capture"
export AB_VARIANTS="new=.gpu/fp4moe nohalf=.gpu/fp4moe@FP4MOE_DEFINES=PF_HALF_TILES=0 noidle=.gpu/fp4moe@FP4MOE_DEFINES=PF_IDLE_WG=0"
bash scripts/gpu-ab.sh 2>&1 | tail -40
