#!/usr/bin/env bash
# One H200, one call (~150 s): issue 16, seventh session (branch quant7).
# - GPU tests (background, $TESTS): the quantized GEMVs (both e4m3 decoders, the int4 byte permutes,
#   the 16-byte x loads) against their numpy references; nothing is timed until they end.
# - init-model: an A3B-shaped model of $LAYERS layers x 32 experts (24: a batch-1 step is GPU-bound;
#   at 8 it measured the host).
# - tools/device/quant7_speed.py: the expert FFN kernels (L2 rotated), then bench decode with bf16 /
#   fp8 / int4 experts in a cache of bf16's 25% MiB and all resident; the table at the end.
#   SECTIONS='kernels decode' by default.
source tools/device/setup.sh
set -o pipefail
LAYERS=${LAYERS:-24}
M=/tmp/a3b-${LAYERS}x32
SECTIONS=${SECTIONS:-kernels decode}
TESTS=${TESTS:-tests/cuda/test_moe_quant.py}
echo "== GPU tests (background), init-model $LAYERS x 32"; date
MOEBUS_TEST_GPU=1 timeout ${TESTS_S:-80} python3 -m pytest -q -p no:cacheprovider $TESTS > $OUT/gpu_tests.txt 2>&1 &
export WAIT_PID=$!  # quant7_speed.py compiles meanwhile but times nothing until the tests end
case " $SECTIONS " in *" decode "*)
  timeout ${INIT_S:-45} python3 -m moebus.cli init-model $M --preset a3b --layers $LAYERS --experts 32 > /dev/null 2>&1 ;; esac
echo "== $SECTIONS"; date
(cd tools/device && timeout ${SPEED_S:-110} python3 quant7_speed.py $M $SECTIONS 2>&1) \
  | grep -v Warn | tee $OUT/quant7_speed.txt | grep -v '^{'
wait $WAIT_PID
echo "== GPU tests"; grep -E "passed|failed|FAILED|Error|skipped" $OUT/gpu_tests.txt | tail -8
python3 tools/device/quant7_speed.py --table $OUT/quant7_speed.txt | tee $OUT/table.txt
date
