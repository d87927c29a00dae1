#!/usr/bin/env bash
# Compiles the sm_90a kernels of every staged `fp4moe` binary here, with NVRTC from the CI venv
# (.ci/run makes it), into .gpu/kc/ (.gpu/alt-NAME/kc/ for scripts/stage-alt.sh builds), so a
# device call starts from a warm kernel cache instead of spending ~50-100 s in NVRTC there. The
# cache key (source, headers, options but the include path, NVRTC major.minor, arch) is the same
# on both machines while both have NVRTC 13.0 (the device's driver is CUDA 13.0). gpu-ab.sh copies
# these into its caches; elsewhere: `cp -r .gpu/kc /tmp/kc; export FP4MOE_CACHE_DIR=/tmp/kc`.
# STAGE_DEFINES="SET …" also compiles each binary's kernels under those FP4MOE_DEFINES sets
# (joined by +, e.g. "DECODE_DEEP_DEPTH=4 DECODE_WIDE_DEPTH=3+X=1"); a file's cache key holds
# the defines it names, so one directory serves gpu-ab.sh's `BIN@FP4MOE_DEFINES=…` variants
# too, and they share the CUBINs of the files they do not touch. A set that fails (a spill, a
# compile error) is reported and skipped.
#   ../shared/tools/gpu-stage …; [scripts/stage-alt.sh REV …;] scripts/stage-kernels.sh
set -euo pipefail
root=$(git rev-parse --show-toplevel)
[ -d "$root/.gpu" ] || { echo "run ../shared/tools/gpu-stage first"; exit 1; }
venv="${FP4MOE_NVRTC_VENV:-$HOME/.cache/fp4moe-nvrtc-venv}"
nv=$(echo "$venv"/lib/python3*/site-packages/nvidia/cu13)
[ -d "$nv/lib" ] || { echo "no NVRTC venv at $venv: run .ci/run once (it creates it)"; exit 1; }
for bin in "$root"/.gpu/fp4moe "$root"/.gpu/alt-*/fp4moe; do
  [ -x "$bin" ] || continue
  kc=$(dirname "$bin")/kc
  rm -rf "$kc"
  for defs in "" ${STAGE_DEFINES:-}; do
    LD_LIBRARY_PATH="$nv/lib" FP4MOE_CACHE_DIR="$kc" FP4MOE_DEFINES="$defs" "$bin" compile-kernels --arch sm_90a > /dev/null \
      || { [ -n "$defs" ] && echo "warning: FP4MOE_DEFINES=$defs did not compile cleanly (skipped)"; } || exit 1
  done
  echo "staged $kc ($(du -sh "$kc" | cut -f1))"
done
