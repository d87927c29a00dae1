#!/usr/bin/env bash
# Session 48 call 1 (run 219; its benches/peers/bf16_gemm_rate.py was the first form of benches/peers/yardsticks.py, the compute part as committed): where the prefill GEMMs' distance to the compute floor goes, on
# today's kernels (a854822; wip/ablate-s48 adds timing-only defines, default off, same SASS):
# `--stages` at 1024/4096/16384, both presets, sustained clock, variants base / nodq
# (PF_ABLATE_DEQUANT: raw words for the conversion) / noepi (PF_ABLATE_EPI: no epilogue) / none
# (both); cuBLAS bf16 on the same GEMMs (benches/peers/bf16_gemm_rate.py: dense and balanced
# bmm, plus 8192^3 boost vs sustained); ncu (locked clock) pipe activity and stalls of the
# default prefill kernels at Nemotron 4096 (dual) / 16384 (wide GEMM1), and of nodq's wide GEMM1.
export AB_TESTS=0 AB_ROUNDS=1 AB_TOKENS=1024,4096,16384 AB_DEADLINE=300 AB_BENCH_ARGS=--stages
export AB_SETTLE_MS=1500 AB_MIN_TIME_MS=500
export AB_VARIANTS="base=.gpu/fp4moe nodq=.gpu/fp4moe@FP4MOE_DEFINES=PF_ABLATE_DEQUANT=1 noepi=.gpu/fp4moe@FP4MOE_DEFINES=PF_ABLATE_EPI=1 none=.gpu/fp4moe@FP4MOE_DEFINES=PF_ABLATE_DEQUANT=1+PF_ABLATE_EPI=1"
bash scripts/gpu-ab.sh 2>&1 | grep -v "^cp:" | tail -12
R=/tmp/res
for f in $R/ab-*.txt; do echo "== $f"; grep -A4 "^stages" $f | tail -3; done
PY=/opt/torch/.venv/bin/python3; [ -x $PY ] || PY=python3
for p in nemotron3-nano qwen3-30b-a3b; do
  timeout 150 $PY benches/peers/bf16_gemm_rate.py --preset $p --json $R/cublas-$p.json > $R/cublas-$p.txt 2>&1
  cat $R/cublas-$p.txt | tail -6
done
tar czf "$OUT/res.tgz" -C /tmp res
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu); KC=/tmp/kcn; mkdir -p $KC; cp .gpu/kc/* $KC/
for v in "base 4096 prefill_dual_gemm1" "base 4096 prefill_dual_gemm2" "base 16384 prefill_wide_gemm1" "nodq 16384 prefill_wide_gemm1"; do
  set -- $v; d=""; [ $1 = nodq ] && d=PF_ABLATE_DEQUANT=1
  f=$R/ncu-$1-$2-$3.txt
  timeout 80 env FP4MOE_CACHE_DIR=$KC FP4MOE_DEFINES=$d $NCU --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio" \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --print-details all \
    -k "regex:$3" --launch-count 1 .gpu/fp4moe bench --preset nemotron3-nano --tokens $2 --backend cuda --settle-ms 0 --min-time-ms 0 --warmup-ms 0 --iterations 1 --inputs 1 > $f 2>&1
  echo "== ncu $v"; grep -E "Duration|SM Frequency|Issue Active|Pipe Tensor Cycles|Pipe Alu Cycles|Pipe Fma Cycles|==ERR" $f | head -8
  tar czf "$OUT/res.tgz" -C /tmp res
done
