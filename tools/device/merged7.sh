#!/usr/bin/env bash
# (Ran once, at 81ac91c: tests/cuda/test_copy_fence.py was in its list then; the chained prefill
# copies it tested were reverted after this call's measurement, and so was the test.)
# One H200, the seventh session's merged tree in one short call (~340 s wall; the session had ~430 s
# of device time left, start included): GPU tests of what changed and was not run on a GPU after its
# last edit (the prefill copies beside the layer before, the router in flight, the quantized words,
# the fused attention's planes and reordered products, the decode tiles), graph == eager on 4 x 32
# (all resident and a 25% cache), then on 48 x 32 A3B (bf16, bf16 KV): decode batch 1 / 8 in-process,
# a 2048-token prompt through a 25% cache against all resident (bit for bit, and its time), decode of
# 64 sequences as GEMVs vs tiles. Sections in order of need: a cut call loses the last. Logs under $OUT.
source tools/device/setup.sh
set -o pipefail
M=/tmp/m48; M4=/tmp/m4; T0=$(date +%s)
now() { echo $(( $(date +%s) - T0 )); }
(timeout 100 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $OUT/init48.log 2>&1
 echo "init48 rc=$? at $(now) s" >> $OUT/init48.log) &
INIT=$!
timeout 40 python3 -m moebus.cli init-model $M4 --preset a3b --layers 4 --experts 32 > $OUT/init4.log 2>&1
echo "== GPU tests at $(now) s"
MOEBUS_TEST_GPU=1 timeout 85 python3 -m pytest -q -rfE -p no:cacheprovider tests/cuda/test_routing.py tests/cuda/test_moe_quant.py tests/cuda/test_flash_attention.py \
  tests/cuda/test_prefill_tensor_cores.py tests/cuda/test_split_epilogues.py \
  tests/vision/test_qwen3vl_units.py::test_the_captured_encode_equals_the_eager_one_and_a_new_size_captures_anew \
  > $OUT/gpu_tests.txt 2>&1
echo "rc=$?"; grep -aE "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.txt | cut -c1-240 | head -12
echo "== graph == eager (4 x 32) at $(now) s"
timeout 40 python3 tools/device/graph_check.py $M4 2>&1 | tee $OUT/graph_check.txt | grep -aE "vs eager|CHECK|Error"
wait $INIT; tail -1 $OUT/init48.log
echo "== decode 48 x 32, in-process, at $(now) s"
timeout 45 python3 -m moebus.cli bench decode --model $M --device cuda --batch 1,8 --tokens 64 --repeats 2 --no-service \
  2>&1 | grep -av Warn | tee $OUT/decode.txt | tail -3
echo "== 2048 tokens through a 25% cache vs all resident, at $(now) s"
(cd tools/device && timeout 75 python3 prefill_cache_check.py $M 2048 0.25 2>&1 | grep -av "Warn\|warn(" | tee $OUT/prefill_cache.txt | tail -4)
echo "== decode of 64 sequences, GEMVs vs tiles, at $(now) s"
timeout 70 python3 tools/device/prefill7_decode.py $M 64 8 2>&1 | grep -av "Warn\|warn(" | tee $OUT/tiles.txt | tail -6
echo "end at $(now) s"
