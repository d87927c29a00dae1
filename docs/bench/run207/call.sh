#!/usr/bin/env bash
# Session 45 call 5 (run 207): the review's simplification of the half tiles (the copy count
# from the computed slots' pieces instead of a per-piece flag; the same registers on sm_90a and
# sm_80): the prefill tests, default-path sweeps, token order, moe_golden, moe_random.
export AB_TESTS=1 AB_ROUNDS=0 AB_TEST_TIMEOUT=300
export AB_TEST_FILTER="prefill nemotron_shape_every gated_widths outputs_do_not_depend graph_capture"
bash scripts/gpu-ab.sh 2>&1 | tail -12
