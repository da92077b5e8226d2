#!/usr/bin/env bash
# One H200, the fifth session's merged tree in one short call (~330 s; the session had ~420 s left):
# the GPU tests of what this session changed (tests/vision whole, the changed tests/cuda files);
# issue 19's prefill and issue 17's schema bench on a 24 x 32 A3B-shaped model with the served KV
# default (bf16); issue 20's vision cycle under 8 GiB (hand-back between decode steps). Logs under $OUT.
source tools/device/setup.sh
set -o pipefail
V=/tmp/a3b-8x128-vision; S=/tmp/m24
(timeout 120 python3 -m moebus.cli init-model $S --preset a3b --layers 24 --experts 32 > $OUT/init_s.log 2>&1;
 timeout 120 python3 -m moebus.cli init-model $V --preset a3b --layers 8 --vision siglip > $OUT/init_v.log 2>&1) &
INIT=$!
echo "== GPU tests"; date
MOEBUS_TEST_GPU=1 timeout ${TESTS_S:-140} python3 -m pytest -v -rfE -p no:cacheprovider tests/vision \
  tests/cuda/test_vmm_arena.py tests/cuda/test_launch_ahead.py tests/cuda/test_moe_quant.py tests/cuda/test_gemm.py \
  tests/cuda/test_image_attention_tc.py tests/cuda/test_tower_epilogues.py tests/cuda/test_mrope.py \
  tests/cuda/test_prefill_tensor_cores.py tests/cuda/test_linear.py tests/cuda/test_moe.py > $OUT/gpu_tests.txt 2>&1
echo "rc=$? passed $(grep -c ' PASSED' $OUT/gpu_tests.txt) failed $(grep -c ' FAILED' $OUT/gpu_tests.txt) errors $(grep -c ' ERROR' $OUT/gpu_tests.txt) skipped $(grep -c ' SKIPPED' $OUT/gpu_tests.txt)"
grep -E "^(FAILED|ERROR) " $OUT/gpu_tests.txt | cut -c1-220 | head -20; tail -1 $OUT/gpu_tests.txt
wait $INIT
echo "== 24 x 32: prefill (kv auto = bf16), then decode --schema (batch 8)"; date
timeout 40 python3 -m moebus.cli bench prefill --model $S --device cuda --tokens 2048,8192 --repeats 2 \
  2>&1 | grep -v Warn | tee $OUT/prefill.txt | tail -3
python3 -c "import json; from tests.structured_schemas import SCHEMAS; print(json.dumps(SCHEMAS['nested']))" > /tmp/nested.json
timeout 100 python3 -m moebus.cli bench decode --model $S --device cuda --batch 8 --tokens 128 --repeats 3 \
  --no-service --schema /tmp/nested.json 2>&1 | grep -v Warn | tee $OUT/schema.txt | tail -7
echo "== vision-cycle under 8 GiB (8 x 128 LLaVA, so400m)"; date
timeout 100 python3 -m moebus.cli bench vision-cycle --device cuda --model $V --gpu-memory-mib 8192 -v \
  --idle-s 3 --repeats 2 --text-streams 2 --text-tokens 64 --timeout-s 90 > $OUT/cycle.log 2>&1
grep -E "^\(|cold image|text streams|largest|warm image|target" $OUT/cycle.log
grep -E "VRAM|decode step" $OUT/cycle.log | sed 's/^2026-[0-9-]* //' | cut -c1-160 | head -16
date
