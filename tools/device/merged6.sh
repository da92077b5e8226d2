#!/usr/bin/env bash
# One H200, the sixth session's merged tree in one short call (~380 s wall; the session had ~510 s
# left): the GPU tests of what changed (fused attention, decode graphs captured before READY in one
# shared pool, prefetch, sampling/routing/attention kernels), graph == eager on 4 x 32 (all resident
# and a 25% cache), then 48 x 32 A3B (bf16 experts, bf16 KV): prefill 512/2048/8192, decode batch 1/8
# in-process, and the schema bench through a private broker (issue 17; its worker now captures every
# batch size before READY, so no capture should fall in a timed run). Logs under $OUT.
source tools/device/setup.sh
set -o pipefail
M=/tmp/m48; M4=/tmp/m4
(timeout 100 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $OUT/init48.log 2>&1) &
INIT=$!
timeout 40 python3 -m moebus.cli init-model $M4 --preset a3b --layers 4 --experts 32 > $OUT/init4.log 2>&1
echo "== GPU tests"; date
MOEBUS_TEST_GPU=1 timeout ${TESTS_S:-100} python3 -m pytest -v -rfE -p no:cacheprovider tests/cuda/test_flash_attention.py \
  tests/cuda/test_warm_graphs.py tests/cuda/test_prefetch.py tests/cuda/test_prefetch_stage.py tests/cuda/test_sampling.py \
  tests/cuda/test_sampling_mask.py tests/cuda/test_routing.py tests/cuda/test_launch_ahead.py > $OUT/gpu_tests.txt 2>&1
echo "rc=$? passed $(grep -c ' PASSED' $OUT/gpu_tests.txt) failed $(grep -c ' FAILED' $OUT/gpu_tests.txt) errors $(grep -c ' ERROR' $OUT/gpu_tests.txt) skipped $(grep -c ' SKIPPED' $OUT/gpu_tests.txt)"
grep -E "^(FAILED|ERROR) " $OUT/gpu_tests.txt | cut -c1-220 | head -12; tail -1 $OUT/gpu_tests.txt
echo "== graph == eager (4 x 32)"; date
timeout 45 python3 tools/device/graph_check.py $M4 2>&1 | tee $OUT/graph_check.txt | grep -E "vs eager|CHECK|Error"
wait $INIT; tail -1 $OUT/init48.log
echo "== prefill 48 x 32"; date
timeout 40 python3 -m moebus.cli bench prefill --model $M --device cuda --tokens 512,2048,8192 --repeats 2 \
  2>&1 | grep -v Warn | tee $OUT/prefill.txt | tail -4
echo "== decode 48 x 32, in-process"; date
timeout 45 python3 -m moebus.cli bench decode --model $M --device cuda --batch 1,8 --tokens 64 --repeats 2 --no-service \
  2>&1 | grep -v Warn | tee $OUT/decode.txt | tail -3
echo "== bench decode --schema (batch 8, 2 repeats)"; date
# the in-process runs' compiled kernels serve the private broker's worker too (a user's second start
# loads its own role's; this keeps the call's worker start to its warm captures)
for d in $MOEBUS_CACHE_DIR/kernels/*/; do [ -d $d/local ] && mkdir -p $d/gpu0 && cp -rn $d/local/. $d/gpu0/; done
python3 -c "import json; from tests.structured_schemas import SCHEMAS; print(json.dumps(SCHEMAS['nested']))" > /tmp/nested.json
timeout 130 python3 -m moebus.cli bench decode --model $M --device cuda --batch 8 --tokens 128 --repeats 2 \
  --no-service --schema /tmp/nested.json 2>&1 | grep -v Warn | tee $OUT/schema.txt | grep schema_
date
