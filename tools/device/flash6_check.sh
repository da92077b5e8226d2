#!/usr/bin/env bash
# One H200 (~170 s): the fused (flash) attention kernel. GPU tests (the kernel against its references,
# the towers and prefill through it); attention alone, fused vs materialised (flash6_timing.py); then,
# only if the tests passed: prefill of 48 x 32 A3B layers (bf16 KV, the served default), held-out fidelity at bf16
# KV, the Qwen3-VL tower at 1024 x 768. Logs under $OUT; a table at the end.
source tools/device/setup.sh
set -o pipefail
M=/tmp/m48; Q=/tmp/a3b-qwen3vl
(timeout 60 python3 -m moebus.cli init-model $Q --arch qwen3_vl_moe --preset a3b --layers 4 --experts 16 > $OUT/init_q.log 2>&1;
 timeout 90 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $OUT/init_m.log 2>&1) &
INIT=$!
echo "== GPU tests"; date
MOEBUS_TEST_GPU=1 timeout 45 python3 -m pytest -q -rfE -p no:cacheprovider tests/cuda/test_flash_attention.py \
  tests/cuda/test_image_attention_tc.py tests/vision/test_qwen3vl_tower_tc.py > $OUT/gpu_tests.txt 2>&1
RC=$?
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.txt | cut -c1-300 | head -20
if [ $RC -ne 0 ]; then grep -E "Error|error|Max abs|Mismatch" $OUT/gpu_tests.txt | head -30; fi
echo "== attention alone"; date
timeout 40 python3 tools/device/flash6_timing.py 5 2>&1 | grep -v Warn | tee $OUT/timing.txt
if [ $RC -ne 0 ]; then echo "tests failed: stopping"; exit 1; fi
wait $INIT
echo "== prefill 48 x 32 (kv auto = bf16)"; date
timeout 60 python3 -m moebus.cli bench prefill --model $M --device cuda --tokens 512,2048,8192 --repeats 2 \
  2>&1 | grep -v Warn | tee $OUT/prefill.txt | tail -5
echo "== fidelity at bf16 KV (fused attention) against float32 transformers"; date
timeout 45 python3 tools/device/tc_fidelity.py /tmp/fid split/split/bf16 2>&1 | grep -a -v "Warn\|Loading" | tee $OUT/fidelity.txt | tail -8
echo "== Qwen3-VL tower (a3b, 1024 x 768)"; date
timeout 30 python3 tools/device/vltower_encode.py $Q 5 2>&1 | grep -v "Warn\|warn(" | tee $OUT/tower.txt | head -14
date
