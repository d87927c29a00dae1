#!/usr/bin/env bash
# Session 44 call 5 (run 199): the bench's two timing methods on one machine, interleaved:
# `--settle-ms 0 --min-time-ms 0` (each size over ~30 ms after 300 ms of warm-up, the method
# before session 44) and the new defaults (1.5 s settle, >= 1 s windows), Nemotron and Qwen3
# W4A16 at 8 / 64 / 256 tokens, two rounds.
tar xJf .gpu/kc.tar.xz -C .gpu
R=/tmp/res; mkdir -p $R; KC=/tmp/kc; mkdir -p $KC; cp .gpu/kc/* $KC/
for r in 1 2; do for m in short long; do for p in nemotron3-nano qwen3-30b-a3b; do
  if [ $m = short ]; then A="--settle-ms 0 --min-time-ms 0"; else A=""; fi
  timeout 60 env FP4MOE_CACHE_DIR=$KC .gpu/fp4moe bench --preset $p --tokens 8,64,256 $A --json $R/$m-$p-r$r.json > $R/$m-$p-r$r.txt 2>&1
done; done; done
tar czf "$OUT/res.tgz" -C /tmp res
for f in $R/*.txt; do echo "$(basename $f .txt): $(grep -E '^ +[0-9]+ ' $f | awk '{printf "%s:%s ", $1, $2}')"; done
