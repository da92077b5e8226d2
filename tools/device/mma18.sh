#!/usr/bin/env bash
# Issue 16, eighteenth session (branch mma18): the quantized expert GEMVs at batch 1 on tensor cores (moe_quant_mma.py,
# MOEBUS_QUANT_MMA; fp8, and int4 the same way), alone, one phase, BUDGET ~150 s:
# (1) the GPU tests of tests/cuda/test_moe_quant_mma.py but the decodes (NVRTC compiles, the kernels against their
#     arithmetic in numpy and against the reference within the f16 bound, every swept shape, x past f16's range, the
#     early down kernel's bits), at most 45 s, -x;
# (2) tools/device/mma18_bench.py: A3B shapes, 8 pairs, 16 layers' worth of experts rotating (no L2 reuse), us a
#     launch (cuda events behind a spin kernel, median of 200) of today's numba gate|up and down against the
#     tensor-core kernels at 3 shapes each (fp8) and 2 (int4), their max abs / rel error against the numba kernels'
#     output, at most 60 s;
# (3) the decode tests (option on against off on micro models, fp8 then int4: the same greedy tokens), in the time
#     left (a cold numba cache compiles the micro models' steps first).
# The summary (~16 lines) last; details in $OUT (tests.txt, bench.txt, bench.json, decode.txt). One phase: PHASE
# unset or measure runs all three. Should a warm phase come first anyway (PHASE=warm, beside other branches), it runs
# (1) and (3) only (nothing timed there), and the measure phase then skips what warm already finished.
source tools/device/setup.sh
source tools/device/steps.sh
set -o pipefail
PHASE=${PHASE:-measure}; BUDGET=${BUDGET:-150}; OUT=${OUT:-/tmp/mma18-out}; mkdir -p $OUT; T0=$(date +%s)
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/mma18-nc}  # the tests' cubins serve the bench
T=tests/cuda/test_moe_quant_mma.py
done_in() { grep -qE "[0-9]+ passed" $OUT/$1.txt 2>/dev/null && ! grep -qE "failed|error" $OUT/$1.txt; }
done_in tests || SHOW=3 step tests 20 45 env MOEBUS_TEST_GPU=1 python3 -m pytest -x -q -p no:cacheprovider -rf $T \
  -k "not decode"
[ "$PHASE" = warm ] || SHOW=3 step bench 20 60 python3 tools/device/mma18_bench.py --json $OUT/bench.json
done_in decode || SHOW=3 step decode 15 60 env MOEBUS_TEST_GPU=1 python3 -m pytest -q -p no:cacheprovider -rf $T \
  -k decode
echo "== mma18 ($PHASE) at $(at): tests"
for f in tests decode; do grep -E "passed|failed|error" $OUT/$f.txt 2>/dev/null | tail -1 | cut -c1-200
  grep -E "^FAILED|^ERROR" $OUT/$f.txt 2>/dev/null | head -2 | cut -c1-200; done
sed -n '/== mma18 summary/,$p' $OUT/bench.txt 2>/dev/null | cut -c1-160
