#!/usr/bin/env bash
# One H200, the tenth session's merged tree (integ10), first call: issue 19's last figure first.
#   tests   GPU tests of what changed (chunk attention on tensor cores, the router over 16 blocks, the
#           spanning chunk on tiles, the towers' eager-first capture and packed weights, flash), in the
#           background while the 48 x 32 model is written; graph == eager on 4 x 32 after them;
#   beside  8 streams beside an 8192-token prompt through the service (bench/beside_prefill.compare, as
#           `bench decode --beside-prefill 8192`), per cap in CAPS (MOEBUS_MAX_PREFILL_TOKENS_BESIDE_DECODE),
#           the chunk's attention on tensor cores (the default); the first cap compiles and captures;
#   decode  bench decode --batch 1,8 --no-service on 48 x 32 (the router over 16 blocks), if time is left.
source tools/device/setup.sh
set -o pipefail
M=/tmp/m48; M4=/tmp/m4; BUDGET=${BUDGET:-300}; CAPS=${CAPS:-"16 32"}; T0=$(date +%s)
now() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(now) )); }
upto() { local l=$(left); echo $(( l < $1 ? l - 2 : $1 )); }
quiet() { grep -av "Warn\|warn(" ; }
(timeout 100 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $OUT/init48.log 2>&1
 echo "init48 rc=$? at $(now) s" >> $OUT/init48.log) &
INIT=$!
timeout 40 python3 -m moebus.cli init-model $M4 --preset a3b --layers 4 --experts 32 > $OUT/init4.log 2>&1
echo "== GPU tests at $(now) s"
MOEBUS_TEST_GPU=1 timeout 110 python3 -m pytest -q -rfE -p no:cacheprovider -x \
  tests/cuda/test_attention_chunk_tc.py tests/cuda/test_routing.py tests/cuda/test_spanning_chunk.py \
  tests/cuda/test_host_tiles.py tests/cuda/test_decode_tensor_cores.py tests/vision/test_tower_capture_after_reply.py \
  tests/vision/test_qwen3vl_tower_tc.py tests/workers/test_vision_weight_pack.py tests/cuda/test_flash_attention.py \
  > $OUT/gpu_tests.txt 2>&1 || MOEBUS_TEST_GPU=1 timeout 60 python3 -m pytest -q -rfE -p no:cacheprovider \
  tests/cuda/test_attention_chunk_tc.py tests/cuda/test_routing.py tests/cuda/test_spanning_chunk.py \
  tests/vision/test_tower_capture_after_reply.py tests/vision/test_qwen3vl_tower_tc.py >> $OUT/gpu_tests.txt 2>&1
echo "rc=$?"; grep -aE "^(FAILED|ERROR)|passed|failed|rror" $OUT/gpu_tests.txt | cut -c1-260 | head -14
timeout 60 python3 tools/device/graph_check.py $M4 2>&1 | grep -aE "vs eager|CHECK|Error|same" | head -8
wait $INIT; tail -1 $OUT/init48.log
first=160
for cap in $CAPS; do
  (( $(left) > 40 )) || break
  echo "== 8 streams beside 8192, cap $cap, at $(now) s"
  MOEBUS_MAX_PREFILL_TOKENS_BESIDE_DECODE=$cap timeout $(upto $first) python3 -c "
import json; from moebus.bench.beside_prefill import compare
print(json.dumps(compare('$M', 'cuda', [8192], quiet=False)))" 2>$OUT/beside_$cap.err | tail -1
  echo "rc=$?"; grep -a "Error\|beside_prefill:" $OUT/beside_$cap.err | tail -6 | cut -c1-260
  first=60
done
if (( $(left) > 45 )); then
  echo "== decode 48 x 32, in-process, at $(now) s"
  timeout $(upto 60) python3 -m moebus.cli bench decode --model $M --device cuda --batch 1,8 --tokens 64 --repeats 2 \
    --no-service 2>&1 | quiet | tail -4
fi
echo "end at $(now) s"
