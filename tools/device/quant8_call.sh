#!/usr/bin/env bash
# One H200, one call (~130 s; a partial log keeps the configs that finished): issue 16, eighth session (branch quant8).
# - GPU tests (background, $TESTS): the FP8 dense GEMV (both e4m3 decoders) and its bf16 conversion
#   against their numpy references; nothing is timed until they end.
# - init-model: an A3B-shaped model of $LAYERS layers x 32 experts (24: a batch-1 step is GPU-bound).
# - tools/device/quant8_speed.py: bench decode, experts bf16 / fp8 / int4 with attention bf16 or fp8,
#   all resident and in a cache of bf16's 25% MiB, batch 1 and 8; the table at the end.
# - PROFILE (optional, "EXPERTS:ATTENTION ..."): quant8_profile.py, GPU time by kernel of replayed steps.
source tools/device/setup.sh
set -o pipefail
LAYERS=${LAYERS:-24}
M=/tmp/a3b-${LAYERS}x32
TESTS=${TESTS:-tests/cuda/test_linear_quant.py}
echo "== GPU tests (background), init-model $LAYERS x 32"; date
MOEBUS_TEST_GPU=1 timeout ${TESTS_S:-40} python3 -m pytest -q -p no:cacheprovider $TESTS > $OUT/gpu_tests.txt 2>&1 &
export WAIT_PID=$!
timeout ${INIT_S:-40} python3 -m moebus.cli init-model $M --preset a3b --layers $LAYERS --experts 32 > /dev/null 2>&1
echo "== decode"; date
(cd tools/device && timeout ${SPEED_S:-80} python3 quant8_speed.py $M 2>&1) \
  | grep -v Warn | tee $OUT/quant8_speed.txt | grep -v '^{'
wait $WAIT_PID
echo "== GPU tests"; grep -E "passed|failed|FAILED|Error|skipped" $OUT/gpu_tests.txt | tail -8
python3 tools/device/quant8_speed.py --table $OUT/quant8_speed.txt | tee $OUT/table.txt
# PROFILE="bf16:bf16 fp8:fp8 fp8:bf16": GPU time by kernel of replayed steps at batch 1 and 8 (~20 s each)
for c in $PROFILE; do
  (cd tools/device && timeout ${PROFILE_S:-40} python3 quant8_profile.py $M ${c%%:*} ${c##*:} 1 8 2>&1) \
    | grep -v Warn | tee -a $OUT/quant8_profile.txt
done
date
