#!/usr/bin/env bash
# Session 43, three short calls after run 193 on the same staged build (final main's kernels):
# Nemotron W4A16 around 32 tokens, sort_pairs_few (new, the default; X=1 is an unused variable)
# against the general block sort (off: FP4MOE_DEFINES=SORT_FEW=0), interleaved.
# Call a (n-*): the off variant's first runs compiled its kernels past the 30 s timeout (empty).
KC=/tmp/kcq; mkdir -p $KC; cp .gpu/kc/* $KC/
for r in 1 2 3; do for v in new off; do if [ $v = off ]; then D="FP4MOE_DEFINES=SORT_FEW=0"; else D="X=1"; fi
  env FP4MOE_CACHE_DIR=$KC $D timeout 30 .gpu/fp4moe bench --preset nemotron3-nano --tokens 24,32,40 --json $OUT/n-$v-r$r.json > $OUT/n-$v-r$r.txt 2>&1
done; done
# Call b (m-*): compile the off kernels first, then two rounds at 24, 32, 40.
FP4MOE_CACHE_DIR=$KC FP4MOE_DEFINES=SORT_FEW=0 timeout 100 .gpu/fp4moe compile-kernels --arch sm_90a
for r in 1 2; do for v in off new; do …; .gpu/fp4moe bench --preset nemotron3-nano --tokens 24,32,40 > $OUT/m-$v-r$r.txt; done; done
# Call c (k-*): three rounds at 36, 40, 44, 48.
for r in 1 2 3; do for v in off new; do …; .gpu/fp4moe bench --preset nemotron3-nano --tokens 36,40,44,48 > $OUT/k-$v-r$r.txt; done; done
