#!/usr/bin/env bash
# The lead's part of the sixteenth session's calls (lead12_call.sh with S=16, part "lead").
#   PHASE=warm, PHASE=final: lead15.sh's (warm: compiles and graph == eager on a 4 x 32 model; final: worker starts,
#                  GPU tests (GPU_TESTS), graph == eager, b1/b8 with 3 repeats); warm also compiles decode-context.
#   PHASE=measure  issue 15's table on $M48 in one run: lead15.sh's (b1/b8 all resident in-process and through the
#                  service, a 25% cache in-process), then the 32k / 1k ratio (decode-context, bf16 KV); summary last.
#                  With LEAD=check instead: graph == eager on the 4 x 32 model, then the GPU tests (GPU_TESTS).
if [[ $PHASE != measure ]]; then
  bash tools/device/lead15.sh; rc=$?
  [[ $PHASE == warm ]] && (source tools/device/setup.sh; timeout 60 python3 tools/device/decode14_context.py -- \
    --model /tmp/lead-m4 --device cuda --contexts 1024 --kv-dtype bf16 --tokens 8 --repeats 1 > $OUT/warm_context.txt 2>&1
    echo "warm context rc=$?")
  exit $rc
fi
T0=$(date +%s); B=${BUDGET:-240}
if [[ $LEAD == check ]]; then  # call B: the merged defaults' correctness on the GPU (the 4 x 32 model made in warm)
  source tools/device/setup.sh
  timeout $(( B / 2 )) python3 tools/device/graph_check.py /tmp/lead-m4 2>&1 | grep -aE "vs eager|CHECK|Error|same" | head -8
  MOEBUS_TEST_GPU=1 timeout $(( B - $(date +%s) + T0 - 3 )) python3 -m pytest -q -rfE -p no:cacheprovider ${GPU_TESTS:-\
    tests/cuda/test_attention_decode_tc.py tests/cuda/test_moe_quant_resident.py tests/cuda/test_qkv_gemv.py \
    tests/cuda/test_kernel_cache.py tests/cuda/test_pdl.py tests/cuda/test_attention.py} > $OUT/gpu_tests.txt 2>&1
  echo "gpu tests rc=$?"; grep -aE "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.txt | cut -c1-240 | head -12
  exit 0
fi
BUDGET=$(( B - ${CONTEXT_S:-30} )) bash tools/device/lead15.sh > $OUT/table.txt 2>&1
source tools/device/setup.sh
l=$(( B - $(date +%s) + T0 - 2 ))
echo "== decode-context on M48 (1k, 4k, 32k, bf16 KV), at most $l s"
timeout $l python3 tools/device/decode14_context.py -- --model $M48 --device cuda --contexts 1024,4096,32768 \
  --kv-dtype bf16 --tokens 32 --repeats 2 > $OUT/context.txt 2>&1; echo "context rc=$?"
tail -c 1800 $OUT/table.txt; grep -av "Warn\|warn(\|moebus.cublas" $OUT/context.txt | tail -6
