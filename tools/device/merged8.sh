#!/usr/bin/env bash
# One H200, the eighth session's merged tree in one call (~370 s wall; the session had ~460 s of device
# time left, start included). Sections in order of need, each only while BUDGET lasts:
#   tests    GPU tests of what changed and was not run on a GPU after its last edit (the fused
#            attention's tile pipeline and test expectations, the LayerNorm kernel with a store, the
#            Qwen3-VL tower's graph key, the GEMVs' work shapes, few-rows products and decode tiles,
#            the FP8 attention GEMV), beside graph == eager on 4 x 32 (all resident and a 25% cache);
#   decode   48 x 32 A3B (bf16, bf16 KV): bench decode --batch 1,8 in-process (the merged defaults);
#   cache    the same at a 25% cache (the admission margin's new default, 1);
#   prefill  tc8_prefill.py: 2048 (median of 5) and 8192 all resident, 2048 through a 25% cache with
#            bench prefill's and prefill_cache_check's prompts, one process per cache;
#   service  bench decode --batch 1,8 through the service beside in-process.
# Logs under $OUT.
source tools/device/setup.sh
set -o pipefail
M=/tmp/m48; M4=/tmp/m4; BUDGET=${BUDGET:-370}; T0=$(date +%s)
now() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(now) )); }
upto() { local l=$(left); echo $(( l < $1 ? l : $1 )); }  # a section's timeout: its own or what is left
(timeout 100 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $OUT/init48.log 2>&1
 echo "init48 rc=$? at $(now) s" >> $OUT/init48.log) &
INIT=$!
timeout 40 python3 -m moebus.cli init-model $M4 --preset a3b --layers 4 --experts 32 > $OUT/init4.log 2>&1
echo "== GPU tests and graph == eager (4 x 32) at $(now) s"
timeout 80 python3 tools/device/graph_check.py $M4 > $OUT/graph_check.txt 2>&1 & GC=$!
MOEBUS_TEST_GPU=1 timeout 100 python3 -m pytest -q -rfE -p no:cacheprovider tests/cuda/test_flash_attention.py \
  tests/cuda/test_split_epilogues.py tests/cuda/test_layernorm.py tests/cuda/test_linear.py tests/cuda/test_moe.py \
  tests/cuda/test_decode_tensor_cores.py tests/cuda/test_linear_quant.py tests/vision/test_qwen3vl_tower_tc.py \
  tests/vision/test_qwen3vl_units.py::test_the_captured_encode_equals_the_eager_one_and_a_new_size_captures_anew \
  > $OUT/gpu_tests.txt 2>&1
echo "rc=$?"; grep -aE "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.txt | cut -c1-240 | head -12
wait $GC; grep -aE "vs eager|CHECK|Error|same" $OUT/graph_check.txt | head -8
wait $INIT; tail -1 $OUT/init48.log
if (( $(left) > 50 )); then
  echo "== decode 48 x 32, in-process, at $(now) s"
  timeout $(upto 60) python3 -m moebus.cli bench decode --model $M --device cuda --batch 1,8 --tokens 64 --repeats 2 \
    --no-service 2>&1 | grep -av "Warn\|warn(" | tee $OUT/decode.txt | tail -4
fi
if (( $(left) > 50 )); then
  echo "== decode 48 x 32 at a 25% cache, at $(now) s"
  timeout $(upto 60) python3 -m moebus.cli bench decode --model $M --device cuda --batch 1,8 --tokens 32 --repeats 2 \
    --no-service --cache-frac 0.25 2>&1 | grep -av "Warn\|warn(" | tee $OUT/decode25.txt | tail -4
fi
if (( $(left) > 60 )); then
  echo "== prefill 2048 / 8192, all resident and a 25% cache, at $(now) s"
  timeout $(upto 90) python3 tools/device/tc8_prefill.py $M 2048 5 1,0.25 8192 2>&1 | grep -av "Warn\|warn(" \
    > $OUT/prefill.txt
  echo "rc=$?"; grep -a -A12 "^cache" $OUT/prefill.txt
fi
if (( $(left) > 60 )); then
  echo "== decode through the service, at $(now) s"
  timeout $(( $(left) - 3 )) python3 -m moebus.cli bench decode --model $M --device cuda --batch 1,8 --tokens 64 \
    --repeats 2 2>&1 | grep -av "Warn\|warn(" | tee $OUT/service.txt | tail -6
fi
echo "end at $(now) s"
