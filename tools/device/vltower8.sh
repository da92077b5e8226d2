#!/usr/bin/env bash
# One H200 (~120 s of wall): the Qwen3-VL tower (issue 18, branch vltower8). Side by side (neither is
# timed): the GPU tests of what changed (the fused attention's precisions and tile pipeline against
# their numpy twins, its prefill use, the tower on cuda against cpu, captured against eager, the
# towers' copies) and vltower8_fidelity.py (each tower precision against transformers, bar 1e-3);
# then, alone, vltower8_encode.py: the warm encode, its phases, its variants, the attention alone and
# the GPU time by kernel. Logs under $OUT; the figures at the end.
source tools/device/setup.sh
set -o pipefail
echo "== GPU tests and fidelity, side by side"; date
MOEBUS_TEST_GPU=1 timeout 90 python3 -m pytest -q -rfE -p no:cacheprovider tests/cuda/test_flash_attention.py \
  tests/cuda/test_image_attention_tc.py tests/vision/test_qwen3vl_tower_tc.py tests/vision/test_tower_copies.py \
  tests/vision/test_vision_model.py::test_the_captured_encode_equals_the_eager_one \
  tests/vision/test_qwen3vl_units.py::test_the_captured_encode_equals_the_eager_one_and_a_new_size_captures_anew \
  > $OUT/gpu_tests.txt 2>&1 &
TESTS=$!
timeout 90 python3 tools/device/vltower8_fidelity.py > $OUT/fidelity.txt 2>&1
echo "fidelity rc=$?"
grep -aE "^tower|^fidelity|Error" $OUT/fidelity.txt | cut -c1-250
wait $TESTS
echo "tests rc=$?"
grep -aE "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.txt | cut -c1-300 | head -20
echo "== Qwen3-VL tower (a3b shapes, 1024 x 768)"; date
timeout 100 python3 tools/device/vltower8_encode.py 10 2>&1 | grep -av "Warn\|warn(" | tee $OUT/tower.txt
date
