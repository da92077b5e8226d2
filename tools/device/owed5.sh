#!/usr/bin/env bash
# One H200 (~9-10 min), the figures the fifth session owes, on 48 x 32 A3B-shaped bf16 experts with the
# served KV default (bf16): issue 19's prefill at 512/2048/8192; issue 15's decode in-process and
# through the service (both at the same KV dtype now); issue 17's schema bench (batch 8, nested schema,
# 3 repeats; each run prints its graph captures and eager short steps); issue 18's Qwen3-VL tower
# (graph vs eager, GPU time by kernel). Logs under $OUT.
source tools/device/setup.sh
set -o pipefail
M=/tmp/m48; Q=/tmp/a3b-qwen3vl
timeout 60 python3 -m moebus.cli init-model $Q --arch qwen3_vl_moe --preset a3b --layers 3 --experts 16 > $OUT/init_q.log 2>&1 &
timeout 120 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $OUT/init_m.log 2>&1
echo "== GPU tests of the last commits (rope/mrope share pair_of and rotate_pair; launch-ahead tests)"; date
MOEBUS_TEST_GPU=1 timeout 60 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_rope.py tests/cuda/test_mrope.py \
  tests/cuda/test_launch_ahead.py tests/vision/test_qwen3vl_tower_tc.py 2>&1 | tail -3
echo "== prefill 48 x 32"; date
timeout 90 python3 -m moebus.cli bench prefill --model $M --device cuda --tokens 512,2048,8192 --repeats 3 \
  2>&1 | grep -v Warn | tee $OUT/prefill.txt | tail -4
echo "== decode 48 x 32, in-process and through the service"; date
timeout 150 python3 -m moebus.cli bench decode --model $M --device cuda --batch 1,8 --tokens 64 --repeats 2 \
  2>&1 | grep -v Warn | tee $OUT/decode.txt | tail -20
echo "== bench decode --schema (batch 8)"; date
python3 -c "import json; from tests.structured_schemas import SCHEMAS; print(json.dumps(SCHEMAS['nested']))" > /tmp/nested.json
timeout 220 python3 -m moebus.cli bench decode --model $M --device cuda --batch 8 --tokens 128 --repeats 3 \
  --no-service --schema /tmp/nested.json 2>&1 | grep -v Warn | tee $OUT/schema.txt | tail -8
echo "== Qwen3-VL tower (a3b, 1024 x 768)"; date
timeout 45 python3 tools/device/vltower_encode.py $Q 7 2>&1 | grep -v "Warn\|warn(" | tee $OUT/tower.txt | head -24
date
