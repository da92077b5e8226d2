#!/usr/bin/env bash
# One H200, issue 20 (seventeenth session, branch vis17): the text streams' gaps while the vision worker encodes
# the cold LLaVA image on the same GPU (sixteenth session, call A: encode phase gap median / max 9.4 / 15.6 ms
# against 5.5 before the image). The tower in slices of MOEBUS_TOWER_SLICE_LAYERS encoder layers, each waited for
# and followed by a pause of MOEBUS_TOWER_SLICE_PAUSE_MS (workers/tower_graph.py; off by default): the vision
# worker is a CUDA context of its own, and the GPU time-slices between contexts, so a decode step stretches by
# the tower work (and the switches its launches cause) it shares the GPU with.
#   PHASE=warm     the GPU tests of the slices (a tiny LLaVA: sliced == unsliced bit for bit, eager, as one graph a
#                  slice, and captured and launched by slice without an eager pass; the captured encode == the eager
#                  one; tests/vision/test_tower_slices.py). Little GPU memory; does not touch the LLaVA model
#                  (gap17's warm phase makes it at /tmp/gap-a3b-8x128-vision, marker .gap12-ready).
#   PHASE=measure  after gap17's measure (the model and the kernel cache made): gap12.sh's cycle (gap16.sh's: 8 x
#                  128 A3B LLaVA (so400m), --gpu-memory-mib 8192, 2 text streams, cold start 2 of 2, copy budget 256
#                  MiB, steps and collections logged) in RUNS "tag:VAR=v,...": "off" (the tree's defaults), "s2cap"
#                  (slices of 2 layers, the new shape captured and launched slice by slice, no eager pass, no pause:
#                  MOEBUS_TOWER_SLICE_CAPTURE_FIRST=1; with the NVML gate, MOEBUS_TOWER_SLICE_WHEN=busy, whose reading
#                  the encode line gives), "s1" (the eager first encode in slices of 1 layer with 4 ms pauses) only
#                  where 34 s are left; each at most RUN_CAP s (34; gap16's default ran in 25 s). Then per run: the
#                  vision worker's "encode 1" line (tower ms, its path, its slices and the ms in their cuts) and
#                  gap15_gaps.py's summary (the ratios, the first token by phase, gap median / max by phase, the
#                  largest gaps), and the GPU's time-slice policy (nvidia-smi compute-policy -l, read only).
#   PHASE=measure BUDGET=100 bash tools/device/vis17.sh
source tools/device/setup.sh
set -o pipefail
BUDGET=${BUDGET:-100}
export V=${V:-/tmp/gap-a3b-8x128-vision}
if [ "$PHASE" = warm ]; then
  MOEBUS_TEST_GPU=1 timeout $((BUDGET - 10)) python3 -m pytest -q -p no:cacheprovider tests/vision/test_tower_slices.py \
    tests/vision/test_vision_model.py::test_the_captured_encode_equals_the_eager_one > $OUT/gpu_tests.log 2>&1
  echo "vis17 GPU tests rc=$? at ${SECONDS} s"
  grep -E "passed|failed|Error|assert" $OUT/gpu_tests.log | tail -6 | cut -c1-220
  exit 0
fi
LOGS=MOEBUS_LOG_STEPS=1,MOEBUS_LOG_GC_MS=2
SLICE=MOEBUS_TOWER_SLICE_LAYERS
CAP=MOEBUS_TOWER_SLICE_CAPTURE_FIRST=1,MOEBUS_TOWER_SLICE_PAUSE_MS=0,MOEBUS_TOWER_SLICE_WHEN=busy
RUNS=${RUNS:-off:$LOGS s2cap:$LOGS,$SLICE=2,$CAP s1:$LOGS,$SLICE=1,MOEBUS_TOWER_SLICE_PAUSE_MS=4}
RUNS="$RUNS" RUN_CAP=${RUN_CAP:-34} BUDGET=$((BUDGET - 8)) bash tools/device/gap12.sh > $OUT/gap12.txt 2>&1
for run in $RUNS; do  # every line the workers stamped in each of the largest gaps
  tag=${run%%:*}; L=$OUT/cycle_budget256_$tag.log.gz
  [ -f $L ] && { echo "--- $tag"; timeout 10 python3 tools/device/gap15_gaps.py $L --count 5 | cut -c1-220 | head -60; }
done > $OUT/gap_parts.txt 2>&1
grep -E "^=== |^rc=|not run" $OUT/gap12.txt | cut -c1-160
echo "time-slice policy: $(timeout 5 nvidia-smi compute-policy -l 2>&1 | tr -s ' \n' ' ' | cut -c1-200)"  # (read only)
echo "== vis17 summary at ${SECONDS} s (gap12.txt, gap_parts.txt, the logs)"
for run in $RUNS; do
  tag=${run%%:*}; L=$OUT/cycle_budget256_$tag.log.gz
  [ -f $L ] || { echo "$tag: no log (not run)"; continue; }
  zcat $L | grep " encode 1: [0-9]* image" | tail -1 | sed -E 's/^.* encode 1: /encode 1: /' \
    | cut -c1-200
  timeout 10 python3 tools/device/gap15_gaps.py $L --summary "$tag" 2>/dev/null | head -3 \
    | awk '{print substr($0, 1, NR < 3 ? 240 : 130)}'
done
echo "== vis17 done at ${SECONDS} s"
