#!/usr/bin/env bash
# One H200, one call (~115 s warm with every section): issue 16's quantized expert GEMVs against bf16's.
# The GEMV tests on the GPU (fp8 / int4, and the bf16 expert and linear GEMVs whose accumulate they
# share) run in the background while init-model writes an A3B-shaped model of $LAYERS layers x 32
# experts (default 8: the six bench runs take ~65 s there, 10-14 s each with quantizing at load; at
# 8 layers a batch-1 step is host-bound, so 24 or 48 are needed for the all-resident batch-1 ratio);
# then tools/device/quant_speed.py: the expert FFN kernels alone (GB/s), bench decode batch 1 and 8
# with bf16 / fp8 / int4 experts all resident and in a cache of bf16's 25% in MiB, the gate|up shape
# variants, a per-kernel profile; the table at the end.
# SECTIONS (default: kernels decode variants) and TESTS pick parts, e.g.
#   SECTIONS='kernels variants profile' TESTS=tests/cuda/test_moe_quant.py bash tools/device/quant_speed.sh
source tools/device/setup.sh
set -o pipefail
LAYERS=${LAYERS:-8}
M=/tmp/a3b-${LAYERS}x32
SECTIONS=${SECTIONS:-kernels decode variants}
TESTS=${TESTS:-tests/cuda/test_moe_quant.py tests/cuda/test_moe.py tests/cuda/test_linear.py}
echo "== GPU tests (background), init-model $LAYERS x 32"; date
MOEBUS_TEST_GPU=1 timeout ${TESTS_S:-90} python3 -m pytest -q -p no:cacheprovider $TESTS \
  -k "quant or expert or decode or linear" > $OUT/gpu_tests.txt 2>&1 &
tests=$!
case " $SECTIONS " in *" decode "*)
  timeout 60 python3 -m moebus.cli init-model $M --preset a3b --layers $LAYERS --experts 32 > /dev/null 2>&1 ;; esac
echo "== $SECTIONS"; date
timeout ${SPEED_S:-100} python3 tools/device/quant_speed.py $M $SECTIONS 2>&1 \
  | grep -v Warn | tee $OUT/quant_speed.txt | grep -v '^{'
wait $tests
echo "== GPU tests"; grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests.txt | tail -8
python3 tools/device/quant_speed.py --table $OUT/quant_speed.txt | tee $OUT/table.txt
date
