#!/usr/bin/env bash
# Session 48 call 2 (run 220): the yardsticks (benches/peers/yardsticks.py as of this run: bare
# reads of the touched experts' NVFP4 bytes by int32 sums (too slow to be a yardstick: run 221
# redoes them with f32 sums), cuBLAS bf16 on the expert GEMMs, 8192^3 boost vs sustained), both
# presets; ncu (locked clock) of cuBLAS's bmm on Nemotron's GEMM1 and GEMM2 shapes at 4096 and
# 16384 tokens (tensor pipe, issue, stalls) beside run 219's of fp4moe's kernels.
R=/tmp/res; mkdir -p $R; trap 'tar czf "$OUT/res.tgz" -C /tmp res' EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > $R/gpu.txt
PY=/opt/torch/.venv/bin/python3; [ -x $PY ] || PY=python3
for p in nemotron3-nano qwen3-30b-a3b; do
  timeout 200 $PY benches/peers/yardsticks.py --preset $p --json $R/yardsticks-$p.json > $R/yardsticks-$p.txt 2>&1
  echo "rc=$?"; cat $R/yardsticks-$p.txt
done
cat > /tmp/bmm.py <<'PYEOF'
import sys, torch
e, m, k, n = (int(v) for v in sys.argv[1:5])
a = torch.randn(e, m, k, device="cuda").to(torch.bfloat16)
b = torch.randn(e, k, n, device="cuda").to(torch.bfloat16)
for _ in range(3):
    torch.bmm(a, b)
torch.cuda.synchronize()
PYEOF
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
for v in "4096-g1 128 192 2688 1856" "4096-g2 128 192 1856 2688" "16384-g1 128 768 2688 1856" "16384-g2 128 768 1856 2688"; do
  set -- $v; f=$R/ncu-cublas-$1.txt
  timeout 90 $NCU --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio" \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section LaunchStats --print-details all \
    -k "regex:gemm|nvjet|xmma|cutlass" --launch-skip 1 --launch-count 1 $PY /tmp/bmm.py $2 $3 $4 $5 > $f 2>&1
  echo "== ncu cublas bmm $v"; grep -E "^  [a-z_0-9]+.*\(|Duration|SM Frequency|Issue Active|Pipe Tensor Cycles|Grid Size|Block Size|==ERR" $f | head -9
done
