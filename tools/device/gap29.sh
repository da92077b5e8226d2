#!/usr/bin/env bash
# One H200 (twenty-ninth session's plan for the next; issue 20). The defaults now launch the decode step beside
# the hand-back's unmap and stream LLaVA's encoder layers (measured in the twenty-ninth session, emb27.sh: the
# cold image's largest gap 7.6-9.2 ms, 2.02-2.23x the cycle's median, target <= 2x). One call (~7 min):
#   1. the context-limits GPU test with -s: the stack limit before and after a launch that needs more;
#   2. gap25.sh's cycle (ROUTE=0) over def, def2, def3 (the defaults, a LLaVA vision worker's stack limit 64 B
#      among them: the ratio's spread), stack, stack2 (MOEBUS_CUDA_STACK_BYTES=64 in every worker: the text
#      workers too) and off (both switches 0 and the vision worker at the driver's 1024 B).
#   bash tools/device/gap29.sh 2>&1 | tail -40      (carry .whl)
source tools/device/setup.sh
FINAL=$OUT
MOEBUS_TEST_GPU=1 timeout 90 python3 -m pytest -q -s -p no:cacheprovider tests/cuda/test_context_limits.py 2>&1 \
  | grep -E "stack limit|passed|failed" | head -4
L=MOEBUS_LOG_STEPS=1,MOEBUS_LOG_GC_MS=2
OUT=$FINAL ROUTE=0 MEASURE_S=${MEASURE_S:-250} \
  VIS_RUNS="def:$L stack:$L,MOEBUS_CUDA_STACK_BYTES=64 def2:$L stack2:$L,MOEBUS_CUDA_STACK_BYTES=64 def3:$L off:$L,MOEBUS_HANDBACK_BESIDE_STEP=0,MOEBUS_VISION_STREAM_LAYERS=0,MOEBUS_CUDA_STACK_BYTES=1024" \
  bash tools/device/gap25.sh 2>&1 | grep -vE "^(===|-150)" | tail -30
for tag in def stack stack2; do
  echo "$tag: $(zcat $FINAL/cycle_budget256_$tag.log.gz 2>/dev/null | grep -oE 'encode [0-9]+: .*CUDA stack limit [0-9]+ B' \
    | sed -E 's/: .*(CUDA stack limit)/: \1/' | tr '\n' ';')"
done
echo "== gap29 done at ${SECONDS} s"
