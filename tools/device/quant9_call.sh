#!/usr/bin/env bash
# One H200, one call (~180 s after the machine's start, which took ~98 s on 2026-12-02: ask for ~280 s of
# device time; PLAN=FILE for a shorter plan). The first try, cut at 120 s, measured only bf16:
# the 1-layer init-model ran beside the 24-layer one and ran out of its 20 s, so no warm-up compiled
# anything and the sweep compiled every kernel itself): issue 16, ninth session (branch quant9).
# - in parallel: init-model 24 x 32 (A3B shapes); the quantized GEMVs' GPU tests; three warm-ups
#   (quant9_sweep.py QUICK=1 on a 1-layer model of the same shapes, one part of the plan each) that
#   compile the plan's kernel variants side by side, each into a kernel disk cache of its own (numba
#   numbers a function's entries from its index, so two processes adding variants of one kernel at
#   once could cross them), merged afterwards (quant9_cache_merge.py) into the sweep's;
# - then quant9_sweep.py on 24 x 32 over quant9_plan.json: per (experts, attention) one load, per
#   setting of the GEMVs' constants tok/s at batch 1 and 8 and each kernel's us a call in the graph.
source tools/device/setup.sh
set -o pipefail
M=/tmp/a3b-24x32; W=/tmp/a3b-1x32
date
timeout 30 python3 -m moebus.cli init-model $W --preset a3b --layers 1 --experts 32 > $OUT/init1.log 2>&1  # first, alone
timeout ${INIT_S:-60} python3 -m moebus.cli init-model $M --preset a3b --layers 24 --experts 32 > $OUT/init.log 2>&1 &
NUMBA_CACHE_DIR=/tmp/numba-tests MOEBUS_TEST_GPU=1 timeout ${TESTS_S:-60} python3 -m pytest -q -p no:cacheprovider \
  tests/cuda/test_moe_quant.py tests/cuda/test_linear_quant.py > $OUT/gpu_tests.txt 2>&1 &
n=0
for part in bf16:bf16,fp8:bf16 fp8:fp8 int4:fp8; do
  n=$((n + 1))
  (cd tools/device && NUMBA_CACHE_DIR=/tmp/nc$n QUICK=1 ONLY=$part timeout ${WARM_S:-60} python3 quant9_sweep.py $W \
    ${PLAN:-quant9_plan.json}) > $OUT/warm_$n.txt 2>&1 &
done
wait
echo "== warmed"; date; tail -c 100 $OUT/init.log; echo; grep -h '"setting"\|failed' $OUT/warm_*.txt | cut -c1-160
grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests.txt | tail -6
python3 tools/device/quant9_cache_merge.py /tmp/nc /tmp/nc1 /tmp/nc2 /tmp/nc3
(cd tools/device && NUMBA_CACHE_DIR=/tmp/nc timeout ${SWEEP_S:-100} \
  python3 quant9_sweep.py $M ${PLAN:-quant9_plan.json} ${STEPS:-4}) 2>&1 \
  | grep -v Warn > $OUT/sweep.txt
echo "== sweep rc $?"; date
grep -v '^{' $OUT/sweep.txt | tail -5
python3 tools/device/quant9_sweep.py --table $OUT/sweep.txt
