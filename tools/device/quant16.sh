#!/usr/bin/env bash
# Issue 16, sixteenth session (branch quant16), in the lead's shared call (lead12_call.sh, S=16):
# PHASE=warm (side by side with the other branches, nothing timed, BUDGET ~120 s): a 1-layer a3b model (32 experts,
# /tmp/quant16-m1) first, then together: the GPU tests of the quantized GEMVs (test_moe_quant_resident.py: the
# down GEMV's early loads by residency; test_moe_quant_round.py with INT4_UNROLLED; test_linear_quant_fp8.py,
# test_moe_quant.py, test_linear_quant.py) and three quant16_bench.py QUICK=1 runs on
# the 1-layer model (bf16 / fp8 / int4 parts of the plan and of the 25%-MiB runs, a kernel cache each, merged into
# /tmp/quant16-nc by quant9_cache_merge.py) that compile every kernel variant the measure phase runs.
# PHASE=measure (alone, BUDGET ~116 s): quant16_bench.py on $M48 (48 x 32, quantized at load: no model of ours on
# disk) over tools/device/quant16_plan_b.json (call B: bf16, fp8 without and with the early down loads, int4;
# call A ran PLAN=quant16_plan.json: + int4 unrolled): per (experts, attention) one load, per setting decode all resident at
# batch 1, CUPTI us a kernel ($OUT/table.txt), the greedy ids and log p; then while time is left bench decode at a
# cache of bf16's 25% MiB (fp8, int4, then bf16; batch 1 and 8) in the same process; the summary last.
source tools/device/setup.sh
source tools/device/steps.sh
set -o pipefail
PHASE=${PHASE:-measure}; BUDGET=${BUDGET:-116}; OUT=${OUT:-/tmp/quant16-out}; mkdir -p $OUT; T0=$(date +%s)
W=${W:-/tmp/quant16-m1}; PLAN=tools/device/${PLAN:-quant16_plan_b.json}; NC=/tmp/quant16-nc  # the merged kernel cache
if [ "$PHASE" = warm ]; then
  [ -e $W.ok ] || { timeout 40 python3 -m moebus.cli init-model $W --preset a3b --layers 1 --experts 32 \
    > $OUT/init1.log 2>&1 && touch $W.ok; }
  echo "init 1 layer rc=$? at $(at)"
  ( NUMBA_CACHE_DIR=/tmp/quant16-numba-tests MOEBUS_TEST_GPU=1 timeout $(( $(left) - 8 )) python3 -m pytest -q \
    -p no:cacheprovider -rf tests/cuda/test_moe_quant_resident.py tests/cuda/test_moe_quant_round.py \
    tests/cuda/test_linear_quant_fp8.py tests/cuda/test_moe_quant.py tests/cuda/test_linear_quant.py > $OUT/gpu_tests.txt 2>&1
    echo "gpu tests rc=$? at $(at)" >> $OUT/gpu_tests.txt ) &
  pids=; n=0
  for part in bf16:bf16 fp8:fp8 int4:fp8; do  # side by side, a kernel cache each (quant9_cache_merge.py)
    n=$((n + 1))
    NUMBA_CACHE_DIR=/tmp/quant16-nc$n QUICK=1 ONLY=$part CACHE_BY=$(( T0 + BUDGET )) CACHE_DTYPES=${part%%:*} \
      timeout $(( $(left) - 10 )) python3 tools/device/quant16_bench.py $W $PLAN > $OUT/warm_$n.txt 2>&1 &
    pids="$pids $!"
  done
  wait $pids
  echo "warm sweeps done at $(at)"; grep -h '"setting"\|"cache"\|failed\|Error' $OUT/warm_*.txt | cut -c1-140
  python3 tools/device/quant9_cache_merge.py $NC /tmp/quant16-nc1 /tmp/quant16-nc2 /tmp/quant16-nc3
  for d in /tmp/quant16-nc1 /tmp/quant16-nc2 /tmp/quant16-nc3; do  # NVRTC cubins (flash / chunk attention) too
    (cd $d 2>/dev/null && find . -name '*.cubin' -exec cp -n --parents {} $NC/ \;); done
  wait
  tail -3 $OUT/gpu_tests.txt
  exit 0
fi
MODEL=${MODEL:-$M48}
echo "model $MODEL ($(ls $MODEL 2>/dev/null | wc -l) files), budget $BUDGET s"
CACHE_BY=$(( T0 + BUDGET - ${CACHE_S:-14} )) NUMBA_CACHE_DIR=$NC SHOW=4 \
  step sweep 60 $(( BUDGET - 3 )) python3 tools/device/quant16_bench.py $MODEL $PLAN ${STEPS:-4}
python3 tools/device/quant9_sweep.py --table $OUT/sweep.txt > $OUT/table.txt 2>&1
echo "gpu tests (warm phase):"; grep -E '^FAILED' $OUT/gpu_tests.txt 2>/dev/null | head -3 | cut -c1-200
tail -2 $OUT/gpu_tests.txt 2>/dev/null | cut -c1-200
python3 tools/device/quant16_bench.py --summary $OUT/sweep.txt
