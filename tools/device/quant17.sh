#!/usr/bin/env bash
# Issue 16, seventeenth session (branch quant17), in the lead's shared call (lead12_call.sh, S=17):
# PHASE=warm (side by side with the other branches, nothing timed, BUDGET ~110 s): a 1-layer a3b model (32 experts,
# /tmp/quant17-m1) first, then together: the GPU tests of the one-round GEMVs (test_moe_quant_round.py: the L2
# look-ahead keeps the bits; test_moe_quant_resident.py) and three quant17_bench.py QUICK=1 runs on the 1-layer
# model (bf16 / fp8 / int4 parts of the plan, a kernel cache each, merged into /tmp/quant17-nc by
# quant9_cache_merge.py) that compile every kernel variant the measure phase runs.
# PHASE=measure (alone, BUDGET ~130 s): quant17_bench.py on $M48 (48 x 32, quantized at load) over
# tools/device/quant17_plan.json: per (experts, attention) one load, per setting decode all resident at batch 1
# (tok/s, x bf16 of this call), CUPTI us a kernel ($OUT/table.txt), the greedy ids and log p against the first
# setting; settings: the gate|up L2 look-ahead (GATE_UP_L2_AHEAD) and the down matrix asked of L2 by gate|up
# (L2_DOWN_FROM_GATE_UP), with the register cap that keeps 72 registers where they would take more, and
# MOEBUS_PDL=0 (the true durations); bf16, then fp8, then int4 (whose last settings a cut at BUDGET loses: the
# whole plan takes ~160 s, 130 s reach int4's third setting by the sixteenth session's ~8.5 s a setting).
source tools/device/setup.sh
source tools/device/steps.sh
set -o pipefail
PHASE=${PHASE:-measure}; BUDGET=${BUDGET:-130}; OUT=${OUT:-/tmp/quant17-out}; mkdir -p $OUT; T0=$(date +%s)
W=${W:-/tmp/quant17-m1}; PLAN=tools/device/${PLAN:-quant17_plan_b.json}; NC=/tmp/quant17-nc  # the merged kernel cache
if [ "$PHASE" = warm ]; then
  [ -e $W.ok ] || { timeout 40 python3 -m moebus.cli init-model $W --preset a3b --layers 1 --experts 32 \
    > $OUT/init1.log 2>&1 && touch $W.ok; }
  echo "init 1 layer rc=$? at $(at)"
  ( NUMBA_CACHE_DIR=/tmp/quant17-numba-tests MOEBUS_TEST_GPU=1 timeout $(( $(left) - 8 )) python3 -m pytest -q \
    -p no:cacheprovider -rf ${TESTS:-tests/cuda/test_moe_quant_round.py tests/cuda/test_moe_quant_resident.py} \
    > $OUT/gpu_tests.txt 2>&1
    echo "gpu tests rc=$? at $(at)" >> $OUT/gpu_tests.txt ) &
  pids=; n=0
  for part in bf16:bf16 fp8:fp8 int4:fp8; do  # side by side, a kernel cache each (quant9_cache_merge.py)
    n=$((n + 1))
    NUMBA_CACHE_DIR=/tmp/quant17-nc$n QUICK=1 ONLY=$part \
      timeout $(( $(left) - 10 )) python3 tools/device/quant17_bench.py $W $PLAN > $OUT/warm_$n.txt 2>&1 &
    pids="$pids $!"
  done
  wait $pids
  echo "warm sweeps done at $(at)"; grep -h '"setting"\|failed\|Error' $OUT/warm_*.txt | cut -c1-140
  python3 tools/device/quant9_cache_merge.py $NC /tmp/quant17-nc1 /tmp/quant17-nc2 /tmp/quant17-nc3
  for d in /tmp/quant17-nc1 /tmp/quant17-nc2 /tmp/quant17-nc3; do  # NVRTC cubins (flash / chunk attention) too
    (cd $d 2>/dev/null && find . -name '*.cubin' -exec cp -n --parents {} $NC/ \;); done
  wait
  tail -3 $OUT/gpu_tests.txt
  exit 0
fi
MODEL=${MODEL:-$M48}
echo "model $MODEL ($(ls $MODEL 2>/dev/null | wc -l) files), budget $BUDGET s"
NUMBA_CACHE_DIR=$NC SHOW=4 step sweep 60 $(( BUDGET - 3 )) python3 tools/device/quant17_bench.py $MODEL $PLAN ${STEPS:-4}
python3 tools/device/quant9_sweep.py --table $OUT/sweep.txt > $OUT/table.txt 2>&1
python3 tools/device/quant17_bench.py --summary $OUT/sweep.txt | tee $OUT/summary.txt
echo "gpu tests (warm phase):"; grep -E '^FAILED' $OUT/gpu_tests.txt 2>/dev/null | head -3 | cut -c1-160
tail -2 $OUT/gpu_tests.txt 2>/dev/null | cut -c1-160
