#!/usr/bin/env bash
# Issue 16, fifteenth session (branch quant15), in the lead's shared call (lead12_call.sh, S=15):
# PHASE=warm (side by side with the other branches, nothing timed, BUDGET ~120 s): a 1-layer a3b model
# (32 experts) alone first, then together: the 24 x 32 a3b model (/tmp/quant-m24, ~8 GB), the GPU tests of
# the quantized GEMVs (test_moe_quant_round.py, test_linear_quant_fp8.py: the one-round kernels against numpy,
# on the GPU's e4m3 instruction too; test_moe_quant.py, test_linear_quant.py), and three quant15_bench.py
# QUICK=1 runs on the 1-layer model (bf16 / fp8 / int4 parts of the plan, a kernel cache each, merged into
# /tmp/quant-nc by quant9_cache_merge.py) that compile every kernel variant the measure phase runs.
# PHASE=measure (alone, BUDGET ~90 s): quant15_bench.py on 24 x 32 over tools/device/quant15_plan.json
# (quant9_sweep.py: per (experts, attention) one load; per setting decode all resident, tok/s at batch 1,
# CUPTI us a kernel (all of them: $OUT/table.txt); the greedy ids and log p of each setting), then the summary
# (x bf16, the expert and projection kernels' us a layer, ids against the old kernels') last.
# Without the 24-layer model (init cut in the warm phase): $M48 with the short plan (bf16, fp8 old / defaults).
source tools/device/setup.sh
set -o pipefail
PHASE=${PHASE:-measure}; BUDGET=${BUDGET:-90}; OUT=${OUT:-/tmp/quant15-out}; mkdir -p $OUT
M=/tmp/quant-m24; W=/tmp/quant-m1; PLAN=${PLAN:-quant15_plan.json}; NC=/tmp/quant-nc  # the merged kernel cache
t0=$(date +%s); now() { echo $(( $(date +%s) - t0 )); }
if [ "$PHASE" = warm ]; then
  [ -e $W.ok ] || { timeout 40 python3 -m moebus.cli init-model $W --preset a3b --layers 1 --experts 32 \
    > $OUT/init1.log 2>&1 && touch $W.ok; }
  echo "init 1 layer rc=$? at $(now) s"
  [ -e $M.ok ] || ( timeout $(( BUDGET - $(now) - 5 )) python3 -m moebus.cli init-model $M --preset a3b --layers 24 \
    --experts 32 > $OUT/init24.log 2>&1 && touch $M.ok; echo "init 24 layers rc=$? at $(now) s" >> $OUT/init24.log ) &
  ( NUMBA_CACHE_DIR=/tmp/quant-numba-tests MOEBUS_TEST_GPU=1 timeout $(( BUDGET - $(now) - 8 )) python3 -m pytest -q \
    -p no:cacheprovider -rf tests/cuda/test_moe_quant_round.py tests/cuda/test_linear_quant_fp8.py tests/cuda/test_moe_quant.py \
    tests/cuda/test_linear_quant.py > $OUT/gpu_tests.txt 2>&1
    echo "gpu tests rc=$? at $(now) s" >> $OUT/gpu_tests.txt ) &
  pids=; n=0
  for part in bf16:bf16 fp8:fp8 int4:fp8; do  # side by side, a kernel cache each (quant9_cache_merge.py)
    n=$((n + 1))
    (cd tools/device && NUMBA_CACHE_DIR=/tmp/quant-nc$n QUICK=1 ONLY=$part timeout $(( BUDGET - $(now) - 10 )) \
      python3 quant15_bench.py $W $PLAN) > $OUT/warm_$n.txt 2>&1 &
    pids="$pids $!"
  done
  wait $pids
  echo "warm sweeps done at $(now) s"; grep -h '"setting"\|failed' $OUT/warm_*.txt | cut -c1-120
  python3 tools/device/quant9_cache_merge.py $NC /tmp/quant-nc1 /tmp/quant-nc2 /tmp/quant-nc3
  for d in /tmp/quant-nc1 /tmp/quant-nc2 /tmp/quant-nc3; do  # NVRTC cubins (flash / chunk attention) too
    (cd $d 2>/dev/null && find . -name '*.cubin' -exec cp -n --parents {} $NC/ \;); done
  wait
  tail -1 $OUT/init24.log; tail -3 $OUT/gpu_tests.txt
  exit 0
fi
MODEL=$M
if [ ! -e $M.ok ]; then MODEL=$M48; PLAN=quant15_plan_short.json; echo "no 24-layer model: $M48, the short plan"; fi
(cd tools/device && NUMBA_CACHE_DIR=$NC timeout $(( BUDGET - $(now) - 6 )) python3 quant15_bench.py $MODEL $PLAN ${STEPS:-4}) 2>&1 \
  | grep -v Warn > $OUT/sweep.txt
echo "sweep rc=$? at $(now) s"
grep -v '^{' $OUT/sweep.txt | tail -4 | cut -c1-300
python3 tools/device/quant9_sweep.py --table $OUT/sweep.txt > $OUT/table.txt 2>&1
echo "gpu tests (warm phase):"; grep -E '^FAILED' $OUT/gpu_tests.txt | head -3 | cut -c1-200; tail -2 $OUT/gpu_tests.txt | cut -c1-200
python3 tools/device/quant15_bench.py --summary $OUT/sweep.txt
