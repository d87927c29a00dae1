#!/usr/bin/env bash
# One device call: every staged test with FP4MOE_REQUIRE_GPU=1, compute-sanitizer on the small
# GPU tests, an ncu kernel-time breakdown, `fp4moe bench` for both presets and modes, and the
# PyTorch bf16 peer on the same presets. Run from the repo root on the GPU machine after
# ../shared/tools/gpu-stage. Logs go to $OUT/logs/ as they are written, benchmark JSON beside
# them, and come back as $OUT/logs.tgz (also from a run cut short by the time limit).
# usage: bash scripts/gpu-run.sh [tests] [prefill-tests] [sanitizer] [ncu] [detail] [stalls] [sass] [shapes] [paths] [tiles] [decode] [routes] [bench] [torch]
# (default: all but prefill-tests, which tests covers, and routes)
# NCU_TOKENS (default "1 64 256") picks the ncu batch sizes, BENCH_MODES (default "w4a16 w4a4")
# the bench modes, SAN_BINS / SAN_FILTER the sanitized test executables and cuda_device filter.
set -u
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
L="$OUT/logs"; mkdir -p "$L"
# The device returns at most 8 files per call (run 141 lost its stall reports and --stages
# benches): everything goes back as one archive, also when the call's time limit stops it; ncu
# reports (several MB, for the GUI) stay loose files beside it.
trap 'tar czf "$OUT/logs.tgz" --exclude="*.ncu-rep" -C "$OUT" logs && find "$L" -name "*.ncu-rep" -exec mv {} "$OUT"/ \; && rm -rf "$L"' EXIT
steps="${*:-tests sanitizer ncu detail shapes paths bench torch}"
has() { case " $steps " in *" $1 "*) return 0;; esac; return 1; }
export FP4MOE_REQUIRE_GPU=1 FP4MOE_GOLDEN_DIR="$PWD/.gpu/golden" FP4MOE_CACHE_DIR=/tmp/fp4moe-cache RUST_BACKTRACE=1
export FP4MOE_BIN="$PWD/.gpu/fp4moe"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee $L/gpu.txt
if has tests; then
  bash .gpu/run.sh > $L/tests.txt 2>&1; echo "tests rc=$?"
  grep -E "^test .*FAILED|panicked|rel err|test result|^FAILED" $L/tests.txt | tail -60
  # The mma.sync prefill kernels (what sm_80/86/89 run), compiled for plain sm_90 on this GPU.
  if [ "${MMA_TESTS:-1}" = 1 ]; then
    FP4MOE_CUDA_ARCH=sm_90 .gpu/tests/cuda_device-* --test-threads=1 --nocapture prefill > $L/tests-sm90-mma.txt 2>&1
    echo "prefill tests with FP4MOE_CUDA_ARCH=sm_90 (mma.sync): rc=$?"
    grep -E "panicked|rel err|test result" $L/tests-sm90-mma.txt | tail -30
  fi
fi
if has prefill-tests; then
  .gpu/tests/cuda_device-* --test-threads=1 --nocapture prefill router > $L/tests-prefill.txt 2>&1
  echo "prefill tests: rc=$?"; grep -E "panicked|rel err|test result" $L/tests-prefill.txt | tail -30
  FP4MOE_CUDA_ARCH=sm_90 .gpu/tests/cuda_device-* --test-threads=1 prefill_golden prefill_small > $L/tests-prefill-mma.txt 2>&1
  echo "prefill tests, mma.sync kernels (FP4MOE_CUDA_ARCH=sm_90): rc=$?"; grep -E "panicked|test result" $L/tests-prefill-mma.txt
fi
san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if has sanitizer && [ -n "$san" ]; then
  for tool in memcheck racecheck; do
    for t in ${SAN_BINS:-.gpu/tests/moe_golden-* .gpu/tests/cuda_device-*}; do
      filt=cuda; case "$t" in *cuda_device*) filt="${SAN_FILTER:-graph_capture prefill_golden}";; esac
      n=$(basename "${t%-*}")
      "$san" --tool $tool --error-exitcode 9 "$t" --test-threads=1 $filt > $L/sanitizer-$tool-$n.txt 2>&1
      echo "compute-sanitizer $tool $n: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $L/sanitizer-$tool-$n.txt | head -1)"
    done
  done
fi
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
if has ncu && [ -n "$ncu" ]; then
  for t in ${NCU_TOKENS:-1 64 256}; do
    "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv --launch-skip 0 --launch-count 30 \
      .gpu/fp4moe bench --preset nemotron3-nano --tokens $t --backend cuda --iterations 1 > $L/ncu-nemotron-$t.csv 2>$L/ncu-nemotron-$t.err
    echo "ncu nemotron T=$t (kernel, µs):"
    python3 - $L/ncu-nemotron-$t.csv <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows: print("  no rows"); sys.exit()
h = rows[0]; ki = h.index("Kernel Name"); vi = h.index("Metric Value"); ui = h.index("Metric Unit")
acc = collections.OrderedDict()
for r in rows[1:]:
    v = float(r[vi].replace(",", "")); v = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(r[ui], 1.0) * v
    acc.setdefault(r[ki].split("(")[0], []).append(v)
for k, v in acc.items(): print(f"  {k:<28} n={len(v):<3} median {sorted(v)[len(v)//2]:8.1f}")
PY
  done
fi
if has detail && [ -n "$ncu" ]; then
  # One prefill GEMM under ncu's full set: throughput, pipe use and stall reasons (the dual
  # tiles' GEMM1, which the default runs at 4096 tokens).
  "$ncu" --set full --print-details all -k regex:prefill_dual_gemm1 --launch-count 1 .gpu/fp4moe bench --preset nemotron3-nano \
    --tokens 4096 --backend cuda --iterations 1 > $L/ncu-prefill-full.txt 2>&1
  grep -E "Duration|Throughput|Issue Slots|Issued Ipc|Pipe|Stall|Warp Cycles|Eligible|Active Warps|Bank|Registers|L2 Hit|Executed Ipc|No Eligible|One or More|Theoretical Occ|Achieved Occ|smsp__pcsamp" $L/ncu-prefill-full.txt | head -90
fi
if has stalls && [ -n "$ncu" ]; then
  # Per-reason stall ratios (warps stalled per issued instruction), the sampled stall reasons
  # (SourceCounters), issue and tensor-pipe activity of the prefill kernels today's defaults
  # run (Nemotron): the 32-token tiles at 64 (cp.async) and 256 tokens (TMA), the dual tiles at
  # 4096, GEMM1's wide and GEMM2's dual tiles at 16384 (STALL_KERNELS overrides:
  # TOKENS:KERNEL-REGEX pairs).
  for v in ${STALL_KERNELS:-64:prefill_small_gemm1 256:prefill_small_tma_gemm1 4096:prefill_dual_gemm1 4096:prefill_dual_gemm2 16384:prefill_wide_gemm1 16384:prefill_dual_gemm2}; do
    t=${v%:*} k=${v#*:} f="$L/ncu-stalls-$t-${k//[^A-Za-z0-9_]/_}.txt"
    "$ncu" --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio" \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SourceCounters --print-details all \
      -k "regex:$k" --launch-count 1 .gpu/fp4moe bench --preset nemotron3-nano --tokens "$t" --backend cuda --iterations 1 > "$f" 2>&1
    echo "== stalls $k T=$t"; grep -E "stalled|Duration|Issue Slots|Pipe|Throughput|Warp Cycles|==ERR|error" "$f" | awk '$NF+0 > 0.05 || /Duration|Issue|Pipe|Throughput|Warp Cycles|ERR|error/' | head -40
  done
fi
if has sass && [ -n "$ncu" ]; then
  # Warp-stall samples per SASS instruction (ncu's source page) of one kernel per entry of
  # SASS_KERNELS (TOKENS:KERNEL-REGEX; default the dual GEMM1 at 4096 tokens): on which
  # instructions the barrier, warpgroup-arrive and wait samples of run 111 sit. The report
  # comes back too, for the GUI.
  for v in ${SASS_KERNELS:-4096:prefill_dual_gemm1}; do
    t=${v%:*} k=${v#*:} r="$L/ncu-sass-$t-${k//[^A-Za-z0-9_]/_}"
    "$ncu" --section SourceCounters --section WarpStateStats -k "regex:$k" --launch-count 1 -f -o "$r" \
      .gpu/fp4moe bench --preset nemotron3-nano --tokens "$t" --backend cuda --iterations 1 > "$r.log" 2>&1
    "$ncu" -i "$r.ncu-rep" --page source --print-source sass --csv > "$r.csv" 2>&1
    echo "== sass $k T=$t: rc=$? $(wc -l < "$r.csv") lines"; head -3 "$r.csv"
  done
fi
if has shapes; then
  for shape in narrow wide deep half; do
    echo "== FP4MOE_GEMM_SHAPE=$shape"
    FP4MOE_GEMM_SHAPE=$shape .gpu/fp4moe bench --preset nemotron3-nano --tokens 1,8,64,256 --backend cuda 2>&1 | tail -5 | tee -a $L/shapes.txt
  done
fi
if has paths; then
  for path in decode prefill; do
    echo "== FP4MOE_GEMM_PATH=$path"
    FP4MOE_GEMM_PATH=$path .gpu/fp4moe bench --preset nemotron3-nano --tokens 16,32,64,128,256,512,1024 --backend cuda 2>&1 | tail -9 | tee -a $L/paths.txt
  done
fi
if has tiles; then
  # Decode kernels against both prefill tile sizes across the middle of the token range.
  for v in decode:0 prefill:32 prefill:128 prefill:128x2; do
    echo "== FP4MOE_GEMM_PATH=${v%:*} FP4MOE_PREFILL_TILE=${v#*:}"
    FP4MOE_GEMM_PATH=${v%:*} FP4MOE_PREFILL_TILE=${v#*:} .gpu/fp4moe bench --preset ${TILES_PRESET:-nemotron3-nano} \
      --tokens ${TILES_TOKENS:-8,16,32,64,128,256,512,1024,2048} --backend cuda 2>&1 | tail -10 | tee -a $L/tiles.txt
  done
fi
if has decode; then
  # Decode kernels on the decode path with per-stage times: DECODE_CONFIGS entries are
  # mma, stream (units per block chosen per call) or stream:N (N units forced).
  for preset in ${DECODE_PRESETS:-nemotron3-nano qwen3-30b-a3b}; do
    for c in ${DECODE_CONFIGS:-mma stream}; do
      k=${c%%:*}; u=""; [ "$c" != "$k" ] && u=${c#*:}
      echo "== FP4MOE_DECODE_KERNEL=$k FP4MOE_STREAM_UNITS=$u $preset"
      FP4MOE_GEMM_PATH=decode FP4MOE_DECODE_KERNEL=$k FP4MOE_STREAM_UNITS=$u .gpu/fp4moe bench --preset $preset \
        --tokens ${DECODE_TOKENS:-1,8,64} --backend cuda --stages --iterations ${DECODE_ITERS:-100} 2>&1 \
        | grep -E "^ +[0-9]|stages|rror" | tee -a $L/decode.txt
    done
  done
fi
if has routes; then
  # Fused small-batch routing (route_small) against the split kernels around
  # ROUTE_FUSED_MAX_TOKENS (1), both modes (W4A4 quantizes the input in the same launch).
  for mode in w4a16 w4a4; do
    for route in split fused; do
      echo "== FP4MOE_ROUTE=$route $mode"
      FP4MOE_ROUTE=$route .gpu/fp4moe bench --preset nemotron3-nano --mode $mode --tokens ${ROUTES_TOKENS:-1,2,4,8,16,32,64} \
        --backend cuda 2>&1 | tail -8 | tee -a $L/routes.txt
    done
  done
fi
if has bench; then
  for preset in nemotron3-nano qwen3-30b-a3b; do
    for mode in ${BENCH_MODES:-w4a16 w4a4}; do
      .gpu/fp4moe bench --preset $preset --mode $mode --backend cuda --json "$OUT/bench-$preset-$mode.json" 2>&1 | tee -a $L/bench.txt
    done
  done
fi
if has torch; then
  for preset in nemotron3-nano qwen3-30b-a3b; do
    PY=/opt/torch/.venv/bin/python3; [ -x $PY ] || PY=python3
    $PY benches/peers/torch_moe.py --preset $preset --json "$L/torch-$preset.json" 2>&1 | tee -a $L/bench.txt
  done
fi
