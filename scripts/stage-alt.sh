#!/usr/bin/env bash
# Builds the `fp4moe` binary and the `cuda_device` test executable (ALT_TESTS: other test targets
# too, e.g. ALT_TESTS="cuda_device moe_golden moe_random") of another branch or commit in
# a temporary worktree and stages them under .gpu/alt-NAME/ next to what ../shared/tools/gpu-stage
# staged, so one device call can measure both (kernels are embedded in the binaries):
#   scripts/stage-alt.sh wip/scale-code      # after ../shared/tools/gpu-stage
#   on the device: .gpu/alt-scale-code/fp4moe bench …  /  .gpu/alt-scale-code/cuda_device-* …
set -euo pipefail
rev=${1:?usage: scripts/stage-alt.sh BRANCH-OR-COMMIT}
root=$(git rev-parse --show-toplevel)
[ -d "$root/.gpu" ] || { echo "run ../shared/tools/gpu-stage first"; exit 1; }
name=alt-$(basename "$rev")
wt=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$wt" >/dev/null 2>&1 || true' EXIT
git -C "$root" worktree add --detach "$wt" "$rev" >/dev/null
export CARGO_TARGET_DIR="${ALT_TARGET_DIR:-$root/target/alt}" CARGO_PROFILE_RELEASE_DEBUG=false
(cd "$wt" && cargo build --release --bin fp4moe)
tests=""; for t in ${ALT_TESTS:-cuda_device}; do tests="$tests --test $t"; done
mapfile -t exe < <(cd "$wt" && cargo test --release -p fp4moe $tests --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    try: m=json.loads(l)
    except ValueError: continue
    if m.get("executable") and m.get("profile",{}).get("test"): print(m["executable"])')
rm -rf "$root/.gpu/$name" && mkdir -p "$root/.gpu/$name"
cp "$CARGO_TARGET_DIR/release/fp4moe" "${exe[@]}" "$root/.gpu/$name/"
strip "$root/.gpu/$name"/* 2>/dev/null || true
echo "staged .gpu/$name ($(git -C "$root" rev-parse --short "$rev")): $(ls "$root/.gpu/$name" | tr '\n' ' ')"
