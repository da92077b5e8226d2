#!/usr/bin/env bash
# One H200 call, ~150-170 s (issues 18 + 19, branch vltower): the Qwen3-VL tower on tensor cores and as a
# CUDA graph. (1) GPU tests of the tower, its kernels and the towers' captured encodes (captured ==
# replayed == eager == cpu; every product and attention on the tensor cores); (2) vltower_fidelity.py:
# a bf16 Qwen3-VL-MoE with images of ~400 patches (the tower on tensor cores) vs transformers, 1 and
# 2 images; (3) vltower_encode.py: the worker's warm-up, the first and the warm encode (median of 7,
# graph vs eager) of one 1024x768 image by the tower of `init-model --arch qwen3_vl_moe --preset a3b`,
# and its GPU time by kernel; (4) the cold image request's first token: `bench vision-cycle` on that
# model under an 8 GiB budget (last: cut by its timeout if the call runs long; VLTOWER_CYCLE=0 skips
# it). Logs under $OUT.
set -u
source tools/device/setup.sh
OUT=${OUT:-/tmp/vltower-out}; mkdir -p $OUT
M=/tmp/a3b-qwen3vl
python3 -m moebus.cli init-model $M --arch qwen3_vl_moe --preset a3b --layers 3 --experts 16 > $OUT/init.log 2>&1 &
INIT=$!
echo "== GPU tests"; date
MOEBUS_TEST_GPU=1 timeout 60 python3 -m pytest -q -p no:cacheprovider tests/vision/test_qwen3vl_tower_tc.py \
  tests/cuda/test_tower_epilogues.py tests/cuda/test_image_attention_tc.py tests/cuda/test_mrope.py \
  tests/cuda/test_prefill_tensor_cores.py tests/vision/test_qwen3vl_units.py \
  tests/vision/test_vision_model.py -k "tensor or captured or epilogue or bias or mrope or warm or rotary or cuda or softmax or prefill" \
  > $OUT/gpu_tests.txt 2>&1
echo "rc=$?"; grep -E "passed|failed|^FAILED|^ERROR" $OUT/gpu_tests.txt | tail -12
echo "== fidelity, tower on tensor cores"; date
timeout 50 python3 tools/device/vltower_fidelity.py 2>&1 | grep "fidelity\|Error\|error" | tee $OUT/fidelity.txt
echo "== tower"; date
wait $INIT || { tail -3 $OUT/init.log; exit 1; }
timeout 45 python3 tools/device/vltower_encode.py $M 7 2>&1 | grep -v "Warn\|warn(" | tee $OUT/tower.txt | head -30
if [ "${VLTOWER_CYCLE:-1}" != "0" ]; then
  echo "== vision-cycle (cold first token)"; date
  timeout 60 python3 -m moebus.cli bench vision-cycle --device cuda --model $M --gpu-memory-mib 8192 --idle-s 3 \
    --repeats 3 --image-px 1024 --text-streams 2 --text-tokens 16 --timeout-s 55 > $OUT/cycle.log 2>&1
  echo "rc=$?"
  grep -E "^\(|cold image|warm image|vision worker ready|kernels:|target|text streams" $OUT/cycle.log | tail -14
fi
date
