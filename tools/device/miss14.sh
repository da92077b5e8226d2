#!/usr/bin/env bash
# Branch miss14 (issue 15: a 25% cache at >= 0.90 / 0.85 of the PCIe bound at batch 1 / 8, 48 x 32 A3B bf16),
# run by the lead's tools/device/lead12_call.sh (S=14). Launch-ahead with a cache that evicts
# (MOEBUS_CACHE_LAUNCH_AHEAD, workers/overlap.py) against the default, through miss14_ahead.py.
# PHASE=warm: miss12.sh's 4 x 32 model /tmp/miss-m4 (~0.4 GB) and a short miss14_ahead.py on it (compiles every
# kernel the measure phase runs; nothing timed), then the GPU tests of the switch (tests/cuda/test_cache_launch_ahead.py
# and tests/workers/test_cache_launch_ahead.py with MOEBUS_TEST_GPU=1), what the budget leaves.
# PHASE=measure: miss14_ahead.py on $M48 (the lead's model): the check (launched ahead == one at a time, bit for bit,
# batch 1 and 8), then ROUNDS rounds of default vs ahead at batch 1 and 8 (order alternating), the medians, and
# layer 0's guess from the step before. ROUNDS / TOKENS / STEPS override.
source tools/device/setup.sh
set -o pipefail
T0=$(date +%s); BUDGET=${BUDGET:-105}
now() { echo $(( $(date +%s) - T0 )); }
ROOT=$PWD
cd tools/device
if [ "$PHASE" = warm ]; then
  M=/tmp/miss-m4
  [ -f $M/generation_config.json ] || timeout 40 python3 -m moebus.cli init-model $M --preset a3b --layers 4 \
    --experts 32 > $OUT/init4.log 2>&1
  echo "init4 rc=$? at $(now) s"
  ROUNDS=1 STEPS=3 TIMELINES=ahead@8 CHECK_BUDGET=$(( BUDGET - $(now) - 30 )) timeout $(( BUDGET - $(now) - 25 )) \
    python3 miss14_ahead.py $M 4 2>&1 | grep -av "Warn\|warn(" | tail -12
  echo "warm ahead rc=$? at $(now) s"
  cd "$ROOT"
  MOEBUS_TEST_GPU=1 timeout $(( BUDGET - $(now) - 3 )) python3 -m pytest -q -p no:cacheprovider \
    tests/workers/test_cache_launch_ahead.py tests/cuda/test_cache_launch_ahead.py 2>&1 | tail -15 | tee $OUT/gpu_tests.txt
  echo "gpu tests rc=$? at $(now) s"
  exit 0
fi
echo "== miss14_ahead.py $M48 at $(now) s"
ROUNDS=${ROUNDS:-5} CHECK_BUDGET=$(( BUDGET - $(now) - 4 )) timeout $(( BUDGET - $(now) - 2 )) \
  python3 miss14_ahead.py $M48 ${TOKENS:-32} 2>&1 | grep -av "Warn\|warn(" | tee $OUT/ahead.txt
echo "ahead rc=$? at $(now) s"
