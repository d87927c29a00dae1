#!/usr/bin/env bash
# One device call that A/Bs builds: compiles each variant's kernels, runs the staged test
# executables (in parallel, FP4MOE_REQUIRE_GPU=1), then interleaved `fp4moe bench` rounds of
# every variant, then optionally the documentation sweep and the PyTorch peer. Everything goes to
# /tmp/res and is tarred into $OUT/res.tgz on exit (the device returns few files), also when
# the call's time limit stops it. Run from the repo root on the GPU machine after
# ../shared/tools/gpu-stage (and scripts/stage-alt.sh for other builds).
#
# Variants: AB_VARIANTS="label=BINARY[@VAR=VALUE,...] ...", e.g.
#   AB_VARIANTS="base=.gpu/alt-main/fp4moe new=.gpu/fp4moe knob=.gpu/fp4moe@FP4MOE_PREFILL_TILE=32"
# Other knobs (defaults): AB_TOKENS (1,8,64,256,1024,4096,16384), AB_PRESETS (nemotron3-nano
# qwen3-30b-a3b), AB_ROUNDS (2), AB_TESTS (1: run .gpu/tests/*), AB_SWEEP (0: the first variant's
# sweep over both modes), AB_TORCH (0), AB_YARDSTICKS (0; with AB_TORCH), AB_DEADLINE (540: seconds after which no new bench
# starts), AB_TEST_TIMEOUT (420: seconds per test executable), AB_TEST_FILTER (test name
# filters of every cuda_device* executable, e.g. another build's copied in as cuda_device_alt-*;
# default all), AB_TEST_ENV (VAR=VALUE assignments, space-separated, for the test executables,
# e.g. "FP4MOE_DEFINES=PF_MMA_STEPS=2" to test a kernel define of a variant), AB_MODES (w4a16;
# e.g. "w4a16 w4a4"), AB_SANITIZER (compute-sanitizer tools run beside the tests, before the
# benches, e.g. "memcheck racecheck synccheck", on cuda_device's tests named by
# AB_SANITIZER_FILTER, default one_token; options of a tool after commas; AB_SANITIZER_TIMEOUT,
# 200 s), AB_BENCH_ARGS (more `fp4moe bench` arguments, e.g. --stages), AB_SETTLE_MS and
# AB_MIN_TIME_MS (0 and 0: the A/B rounds time each size over ~30 ms after 300 ms of warm-up, as
# before session 44, at a third of the device time; every variant sees the same clock dips at
# the same place of the token list; the sweep keeps `fp4moe bench`'s defaults). Variants of kernel
# defines (a build with FP4MOE_DEFINES: wip/mma-steps, or the timing-only ablations of
# docs/experiments/prefill-ablate.patch): BIN@FP4MOE_DEFINES=PF_ABLATE_EPI+PF_ABLATE_ACT
# (defines joined by +). Prints the medians of every A/B run last.
set -u
OUT="${OUT:-/tmp/out}"; R=/tmp/res; mkdir -p "$R" "$OUT"
trap 'tar czf "$OUT/res.tgz" -C /tmp res' EXIT
export FP4MOE_REQUIRE_GPU=1 FP4MOE_GOLDEN_DIR="$PWD/.gpu/golden" RUST_BACKTRACE=1
# The CLI tests run the staged binary (there is no cargo target directory here).
export FP4MOE_BIN="${FP4MOE_BIN:-$PWD/.gpu/fp4moe}"
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
deadline=${AB_DEADLINE:-540}
variants=${AB_VARIANTS:-"new=.gpu/fp4moe"}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > "$R/gpu.txt"

# The kernel cache of a binary (every run of one binary shares its compiled kernels).
kernel_cache() { echo "/tmp/kc-$(echo "$1" | md5sum | cut -c1-8)"; }

# run LABEL CMD...: CMD with the variant's binary, kernel cache and environment.
run_variant() {
  local spec=$1; shift
  local label=${spec%%=*} rest=${spec#*=} bin env=()
  bin=${rest%%@*}
  [ "$rest" != "$bin" ] && IFS=, read -r -a env <<< "${rest#*@}"
  timeout 240 env FP4MOE_CACHE_DIR="$(kernel_cache "$bin")" "${env[@]}" "$bin" "$@"
}

# Each binary's kernels once per set of FP4MOE_DEFINES (variants of one binary share its cache;
# timing-only ablation builds, docs/experiments/prefill-ablate.patch, differ in their defines).
declare -A seen
for v in $variants; do
  b=${v#*=}; b=${b%%@*}; d=""
  [[ "$v" =~ FP4MOE_DEFINES=([^,]*) ]] && d=${BASH_REMATCH[1]}
  [ -n "${seen[$b@$d]:-}" ] && continue; seen[$b@$d]=1
  if [ -n "$d" ]; then spec="${v%%@*}@FP4MOE_DEFINES=$d"; else spec="${v%%@*}"; fi
  # A cache compiled beside the binary by scripts/stage-kernels.sh saves NVRTC's time here.
  kc=$(kernel_cache "$b"); mkdir -p "$kc"
  [ -d "$(dirname "$b")/kc" ] && cp -n "$(dirname "$b")"/kc/* "$kc"/ 2>/dev/null
  run_variant "$spec" compile-kernels --arch sm_90a > "$R/compile-${v%%=*}.txt" 2>&1 &
done
wait
echo "compiled at $(el) s" >> "$R/progress.txt"

# compute-sanitizer tools (AB_SANITIZER, e.g. "memcheck racecheck,--racecheck-report=hazard
# synccheck": a tool, then its own options after commas) side by side on cuda_device's tests
# named by AB_SANITIZER_FILTER, each bounded by
# AB_SANITIZER_TIMEOUT seconds, in the background beside the tests (before any bench).
if [ -n "${AB_SANITIZER:-}" ]; then
  san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  read -r -a sf <<< "${AB_SANITIZER_FILTER:-one_token}"
  for spec in $AB_SANITIZER; do
    tool=${spec%%,*}; sa=()
    [ "$spec" != "$tool" ] && IFS=, read -r -a sa <<< "${spec#*,}"
    FP4MOE_CACHE_DIR="$(kernel_cache .gpu/fp4moe)" timeout "${AB_SANITIZER_TIMEOUT:-200}" \
      "$san" --tool "$tool" ${sa[@]+"${sa[@]}"} --error-exitcode 9 .gpu/tests/cuda_device-* "${sf[@]}" \
      --test-threads=1 > "$R/sanitizer-$tool.txt" 2>&1 &
  done
fi

if [ "${AB_TESTS:-1}" = 1 ]; then
  # The test executables embed the kernels of .gpu/fp4moe's build: its cache serves them.
  export FP4MOE_CACHE_DIR="$(kernel_cache .gpu/fp4moe)"
  # A hung test (a kernel that never returns) must not eat the whole call.
  # AB_TEST_FILTER: name filters for cuda_device* (the long ones); the other executables run whole.
  pids=()
  read -r -a te <<< "${AB_TEST_ENV:-}"
  for t in .gpu/tests/*; do
    n=$(basename "${t%-*}"); f=()
    [[ "$n" == cuda_device* ]] && [ -n "${AB_TEST_FILTER:-}" ] && read -r -a f <<< "$AB_TEST_FILTER"
    env ${te[@]+"${te[@]}"} timeout "${AB_TEST_TIMEOUT:-420}" "$t" ${f[@]+"${f[@]}"} --test-threads=1 --nocapture \
      > "$R/test-$n.txt" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  unset FP4MOE_CACHE_DIR
  echo "tests done at $(el) s" >> "$R/progress.txt"
  for f in "$R"/test-*.txt; do
    echo "$(basename "$f"): $(grep -E '^test result' "$f" | tr '\n' ' ')"
    grep -E "panicked|FAILED" "$f" | head -5
  done
fi
wait  # the sanitizers
if [ -n "${AB_SANITIZER:-}" ]; then
  for spec in $AB_SANITIZER; do
    tool=${spec%%,*}
    echo "compute-sanitizer $tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|test result' "$R/sanitizer-$tool.txt" | tr '\n' ' ')"
  done
  echo "sanitizers done at $(el) s" >> "$R/progress.txt"
fi

for r in $(seq 1 "${AB_ROUNDS:-2}"); do
  for v in $variants; do
    for preset in ${AB_PRESETS:-nemotron3-nano qwen3-30b-a3b}; do
      for mode in ${AB_MODES:-w4a16}; do
        [ "$(el)" -gt "$deadline" ] && break 4
        tag="${v%%=*}-$preset$([ "$mode" = w4a16 ] || echo "-$mode")-r$r"
        # /tmp/res lives as long as the machine: a label reused by a later invocation in the
        # same call gets a suffix instead of overwriting the earlier results (run 105 lost some).
        while [ -e "$R/ab-$tag.txt" ]; do tag="$tag+"; done
        run_variant "$v" bench --preset "$preset" --mode "$mode" --tokens "${AB_TOKENS:-1,8,64,256,1024,4096,16384}" \
          --backend cuda --settle-ms "${AB_SETTLE_MS:-0}" --min-time-ms "${AB_MIN_TIME_MS:-0}" ${AB_BENCH_ARGS:-} \
          --json "$R/ab-$tag.json" > "$R/ab-$tag.txt" 2>&1
      done
    done
  done
  echo "A/B round $r done at $(el) s" >> "$R/progress.txt"
done

if [ "${AB_SWEEP:-0}" = 1 ]; then
  first=${variants%% *}
  for preset in nemotron3-nano qwen3-30b-a3b; do
    for mode in w4a16 w4a4; do
      [ "$(el)" -gt "$deadline" ] && break 2
      run_variant "$first" bench --preset "$preset" --mode "$mode" --backend cuda \
        --json "$R/$preset-$mode.json" > "$R/$preset-$mode.txt" 2>&1
    done
  done
  echo "sweep done at $(el) s" >> "$R/progress.txt"
fi
if [ "${AB_TORCH:-0}" = 1 ]; then
  PY=/opt/torch/.venv/bin/python3; [ -x $PY ] || PY=python3
  for preset in nemotron3-nano qwen3-30b-a3b; do
    [ "$(el)" -gt "$deadline" ] && break
    $PY benches/peers/torch_moe.py --preset "$preset" --json "$R/torch-$preset.json" > "$R/torch-$preset.txt" 2>&1
  done
  echo "torch done at $(el) s" >> "$R/progress.txt"
  # AB_YARDSTICKS=1: what the card reaches on the same bytes and FLOPs (benches/peers/yardsticks.py).
  if [ "${AB_YARDSTICKS:-0}" = 1 ]; then
    for preset in nemotron3-nano qwen3-30b-a3b; do
      [ "$(el)" -gt "$deadline" ] && break
      $PY benches/peers/yardsticks.py --preset "$preset" --json "$R/yardsticks-$preset.json" > "$R/yardsticks-$preset.txt" 2>&1
    done
    echo "yardsticks done at $(el) s" >> "$R/progress.txt"
  fi
fi
cat "$R/progress.txt"
python3 - "$R" <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(sys.argv[1] + "/ab-*.json")):
    d = json.load(open(f))
    print(os.path.basename(f)[3:-5], [(r["tokens"], round(r["median_us"], 1)) for r in d["results"]])
PY
