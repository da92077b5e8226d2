#!/usr/bin/env bash
# One H200 (~70 s of wall, at most ~145): the Qwen3-VL tower (issue 18). GPU tests of what changed (the fused
# attention's bf16 planes, the split epilogues, the tower on cuda against cpu, captured against eager;
# the prefill use of the kernel), then vltower7_encode.py: warm encode as a graph, its variants, the
# attention alone and the GPU time by kernel. Logs under $OUT; the figures at the end.
source tools/device/setup.sh
set -o pipefail
echo "== GPU tests"; date
MOEBUS_TEST_GPU=1 timeout 70 python3 -m pytest -q -rfE -p no:cacheprovider tests/cuda/test_flash_attention.py \
  tests/cuda/test_split_epilogues.py tests/cuda/test_image_attention_tc.py tests/vision/test_qwen3vl_tower_tc.py \
  tests/cuda/test_gemm.py tests/vision/test_vision_model.py::test_the_captured_encode_equals_the_eager_one \
  tests/vision/test_qwen3vl_units.py::test_the_captured_encode_equals_the_eager_one_and_a_new_size_captures_anew \
  -k "not gemm or image_attention" > $OUT/gpu_tests.txt 2>&1
RC=$?
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.txt | cut -c1-300 | head -20
if [ $RC -ne 0 ]; then grep -E "Error|error|Max abs|Mismatch" $OUT/gpu_tests.txt | head -30; fi
echo "== Qwen3-VL tower (a3b shapes, 1024 x 768)"; date
timeout 70 python3 tools/device/vltower7_encode.py 10 2>&1 | grep -v "Warn\|warn(" | tee $OUT/tower.txt
date
