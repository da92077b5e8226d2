#!/usr/bin/env bash
# One H200, the fifth session's merged tree in one call (~450 s): every GPU test of tests/cuda and
# tests/vision (no -x); issue 20's vision cycle under 8 GiB (hand-back between decode steps);
# issue 18's Qwen3-VL tower (graph vs eager, by kernel); issue 17's schema bench and issue 19's
# prefill on a 24 x 32 A3B-shaped model with the served KV default (bf16). Logs under $OUT.
source tools/device/setup.sh
set -o pipefail
V=/tmp/a3b-8x128-vision; Q=/tmp/a3b-qwen3vl; S=/tmp/m24
(timeout 120 python3 -m moebus.cli init-model $V --preset a3b --layers 8 --vision siglip > $OUT/init_v.log 2>&1;
 timeout 60 python3 -m moebus.cli init-model $Q --arch qwen3_vl_moe --preset a3b --layers 2 --experts 16 > $OUT/init_q.log 2>&1;
 timeout 120 python3 -m moebus.cli init-model $S --preset a3b --layers 24 --experts 32 > $OUT/init_s.log 2>&1) &
INIT=$!
echo "== GPU tests"; date
MOEBUS_TEST_GPU=1 timeout ${TESTS_S:-200} python3 -m pytest -v -rfE -p no:cacheprovider tests/cuda tests/vision \
  > $OUT/gpu_tests.txt 2>&1
echo "rc=$? passed $(grep -c ' PASSED' $OUT/gpu_tests.txt) failed $(grep -c ' FAILED' $OUT/gpu_tests.txt) errors $(grep -c ' ERROR' $OUT/gpu_tests.txt) skipped $(grep -c ' SKIPPED' $OUT/gpu_tests.txt)"
grep -E "^(FAILED|ERROR) " $OUT/gpu_tests.txt | cut -c1-200 | head -20; tail -1 $OUT/gpu_tests.txt
wait $INIT
echo "== vision-cycle under 8 GiB (8 x 128 LLaVA, so400m)"; date
timeout 110 python3 -m moebus.cli bench vision-cycle --device cuda --model $V --gpu-memory-mib 8192 -v \
  --idle-s 3 --repeats 3 --text-streams 2 --text-tokens 64 --timeout-s 100 > $OUT/cycle.log 2>&1
grep -E "^\(|cold image|text streams|largest|warm image|target" $OUT/cycle.log
grep -E "VRAM|decode step" $OUT/cycle.log | sed 's/^2026-[0-9-]* //' | cut -c1-160 | head -24
echo "== Qwen3-VL tower (a3b, 1024 x 768)"; date
timeout 45 python3 tools/device/vltower_encode.py $Q 7 2>&1 | grep -v "Warn\|warn(" | tee $OUT/tower.txt | head -24
echo "== 24 x 32: prefill (kv auto = bf16), then decode --schema (batch 8)"; date
timeout 60 python3 -m moebus.cli bench prefill --model $S --device cuda --tokens 512,2048,8192 --repeats 3 \
  2>&1 | grep -v Warn | tee $OUT/prefill.txt | tail -4
python3 -c "import json; from tests.structured_schemas import SCHEMAS; print(json.dumps(SCHEMAS['nested']))" > /tmp/nested.json
timeout 120 python3 -m moebus.cli bench decode --model $S --device cuda --batch 8 --tokens 128 --repeats 3 \
  --no-service --schema /tmp/nested.json 2>&1 | grep -v Warn | tee $OUT/schema.txt | tail -8
date
