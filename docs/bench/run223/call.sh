#!/usr/bin/env bash
# Session 48 call 5 (run 223): wip/stagger (PF_STAGGER_NS: on the dual prefill tiles, one of
# each SM's two first-wave blocks starts late, so that the pair's epilogues and fills stop
# coinciding; run 219 priced the epilogue at 29 % of GEMM2 at 16384 tokens): the prefill
# tests with the define on; `--stages` A/B at 1024/4096/16384, both presets, sustained,
# base / 4 / 8 / 14 µs.
export AB_TESTS=1 AB_TEST_FILTER="prefill outputs_do_not" AB_TEST_ENV="FP4MOE_DEFINES=PF_STAGGER_NS=8000" AB_TEST_TIMEOUT=200
export AB_ROUNDS=1 AB_TOKENS=1024,4096,16384 AB_DEADLINE=420 AB_BENCH_ARGS=--stages AB_SETTLE_MS=1500 AB_MIN_TIME_MS=500
export AB_VARIANTS="base=.gpu/fp4moe st4=.gpu/fp4moe@FP4MOE_DEFINES=PF_STAGGER_NS=4000 st8=.gpu/fp4moe@FP4MOE_DEFINES=PF_STAGGER_NS=8000 st14=.gpu/fp4moe@FP4MOE_DEFINES=PF_STAGGER_NS=14000"
bash scripts/gpu-ab.sh 2>&1 | grep -v "^cp:" | tail -12
grep -E "test result|panicked" /tmp/res/test-*.txt
for f in /tmp/res/ab-*.txt; do echo "== $f"; grep -A4 "^stages" $f | tail -3; done
