#!/usr/bin/env bash
# Session 48 call 7 (run 225): does the prefill epilogue cost cycles or power? ncu (locked
# clock: duration, tensor pipe) of prefill_dual_gemm2 at 16384 tokens and the dual GEMM1 / GEMM2
# at 4096 (Nemotron), main's kernels (the wip/stagger build, PF_STAGGER_NS off) against the
# timing-only build without the epilogue (wip/ablate-s48, PF_ABLATE_EPI=1), which run 219 timed
# at -29 % (GEMM2, 16384) and -10 / -25 % (4096) in the sustained bench.
R=/tmp/res; mkdir -p $R; trap 'tar czf "$OUT/res.tgz" -C /tmp res' EXIT
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
B="--settle-ms 0 --min-time-ms 0 --warmup-ms 0 --iterations 1 --inputs 1"
mkdir -p /tmp/kc-base /tmp/kc-noepi; cp .gpu/kc/* /tmp/kc-base/; cp .gpu/alt-ablate-s48/kc/* /tmp/kc-noepi/; cp -n .gpu/kc/* /tmp/kc-noepi/
run() {  # label binary defines tokens kernel
  timeout 60 env FP4MOE_CACHE_DIR=/tmp/kc-$1 FP4MOE_DEFINES=$3 $NCU --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --print-details all -k "regex:$5" --launch-count 1 $2 bench --preset nemotron3-nano --tokens $4 $B > $R/ncu-$1-$4-$5.txt 2>&1
  echo "== $1 $4 $5"; grep -E "Duration|SM Frequency|Pipe Tensor Cycles|Issue Active|==ERR" $R/ncu-$1-$4-$5.txt | head -5
}
for k in "16384 prefill_dual_gemm2" "4096 prefill_dual_gemm1" "4096 prefill_dual_gemm2"; do
  run base .gpu/fp4moe "" $k
  run noepi .gpu/alt-ablate-s48/fp4moe PF_ABLATE_EPI=1 $k
done
