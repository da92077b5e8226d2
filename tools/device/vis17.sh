#!/usr/bin/env bash
# One H200, issue 20 (seventeenth session, branch vis17): the text streams' gaps while the vision worker encodes
# the cold LLaVA image on the same GPU. First round: the tower in slices of MOEBUS_TOWER_SLICE_LAYERS encoder
# layers with cuts between them (workers/tower_graph.py; off). Second round (vis18): the deferred capture of the
# tower's graph after the reply (call A: a 29.5 ms chunk step, 9-14 ms over its peers, inside a 59.8 ms capture)
# logged by part, kept off a busy GPU (MOEBUS_TOWER_CAPTURE_WHEN=idle) or without its pinned allocations
# (MOEBUS_TOWER_PIN_AHEAD=1); both off.
#   PHASE=warm     the GPU tests of the slices (a tiny LLaVA: sliced == unsliced bit for bit, eager, as one graph a
#                  slice, and captured and launched by slice without an eager pass; the captured encode == the eager
#                  one; tests/vision/test_tower_slices.py) and of the capture after the reply (a tiny Qwen3-VL: the
#                  replay == the eager encode, its pinned buffers made at the capture or with the eager encode,
#                  MOEBUS_TOWER_PIN_AHEAD; tests/vision/test_tower_capture_after_reply.py). Little GPU memory; does not
#                  touch the LLaVA model (gap17's warm phase makes it at /tmp/gap-a3b-8x128-vision, .gap12-ready).
#   PHASE=measure  after gap17's measure (the model and the kernel cache made; call A's runs from a copy of the tree
#                  were cut at 34 s still warming: call B's merged tree shares the cache, ~25-30 s a cycle): gap12.sh's
#                  cycle (8 x 128 A3B LLaVA (so400m), --gpu-memory-mib 8192, 2 text streams, cold start 2 of 2, copy
#                  budget 256 MiB, steps and collections logged) in RUNS "tag:VAR=v,...", each where 34 s are left, at
#                  most RUN_CAP s (45), the telling pair first (~60 s):
#                    off    the tree's defaults (the capture right after the reply; its log line now by part)
#                    idle   MOEBUS_TOWER_CAPTURE_WHEN=idle: the capture waits for NVML to see the GPU under 10% busy,
#                           so none while the text streams decode (call A: a 29.5 ms chunk step inside a 59.8 ms
#                           capture; is the capture's window slower than the same window without it?)
#                    pin    MOEBUS_TOWER_PIN_AHEAD=1: the capture right after the reply, its pinned staging and
#                           outputs made with the eager encode (does the window lose its slowness? the tower ms?)
#                    s2cap  the first round's candidate (slices of 2 layers captured and launched by slice, the NVML
#                           gate), only where time is left
#                  Then per run: tools/device/vis18_capture.py (the capture's ms by part, the text steps beside its
#                  window against their kind's median in the second after; capture_<tag>.txt whole), gap15_gaps.py's
#                  summary (the ratios and gap median / max by phase; summary_<tag>.txt) and the largest gaps'
#                  lines (gap_parts.txt). ~32 s a run with its reading: BUDGET=125 runs off, idle, pin; 140 all four.
#   PHASE=measure BUDGET=125 bash tools/device/vis17.sh
source tools/device/setup.sh
set -o pipefail
BUDGET=${BUDGET:-125}
export V=${V:-/tmp/gap-a3b-8x128-vision}
if [ "$PHASE" = warm ]; then
  MOEBUS_TEST_GPU=1 timeout $((BUDGET - 10)) python3 -m pytest -q -p no:cacheprovider tests/vision/test_tower_slices.py \
    tests/vision/test_vision_model.py::test_the_captured_encode_equals_the_eager_one > $OUT/gpu_tests.log 2>&1
  echo "vis17 GPU tests (slices; call A: 12 passed in 32 s) rc=$? at ${SECONDS} s"
  grep -E "passed|failed|Error|assert" $OUT/gpu_tests.log | tail -4 | cut -c1-220
  left=$((BUDGET - SECONDS - 5))  # the capture after the reply, PIN_AHEAD on and off (a tiny Qwen3-VL: its kernels)
  [ $left -lt 15 ] && { echo "no time left for the capture's GPU tests (${left} s)"; exit 0; }
  MOEBUS_TEST_GPU=1 timeout $left python3 -m pytest -q -p no:cacheprovider tests/vision/test_tower_capture_after_reply.py \
    > $OUT/gpu_tests_capture.log 2>&1
  echo "vis18 GPU tests (the capture, pinned ahead or not) rc=$? at ${SECONDS} s"
  grep -E "passed|failed|Error|assert" $OUT/gpu_tests_capture.log | tail -4 | cut -c1-220
  exit 0
fi
LOGS=MOEBUS_LOG_STEPS=1,MOEBUS_LOG_GC_MS=2
SLICE=MOEBUS_TOWER_SLICE_LAYERS
CAP=MOEBUS_TOWER_SLICE_CAPTURE_FIRST=1,MOEBUS_TOWER_SLICE_PAUSE_MS=0,MOEBUS_TOWER_SLICE_WHEN=busy
RUNS=${VIS_RUNS:-${RUNS:-off:$LOGS idle:$LOGS,MOEBUS_TOWER_CAPTURE_WHEN=idle pin:$LOGS,MOEBUS_TOWER_PIN_AHEAD=1 s2cap:$LOGS,$SLICE=2,$CAP}}
RUNS="$RUNS" RUN_CAP=${RUN_CAP:-45} BUDGET=$((BUDGET - 8)) bash tools/device/gap12.sh > $OUT/gap12.txt 2>&1
for run in $RUNS; do  # every line the workers stamped in each of the largest gaps; each run's reading whole
  tag=${run%%:*}; L=$OUT/cycle_budget256_$tag.log.gz
  [ -f $L ] || continue
  echo "--- $tag"; timeout 10 python3 tools/device/gap15_gaps.py $L --count 5 | cut -c1-220 | head -60
  timeout 10 python3 tools/device/vis18_capture.py $L --tag $tag > $OUT/capture_$tag.txt 2>&1
  timeout 10 python3 tools/device/gap15_gaps.py $L --summary "$tag" > $OUT/summary_$tag.txt 2>&1
done > $OUT/gap_parts.txt 2>&1
grep -E "^=== |^rc=|not run" $OUT/gap12.txt | sed -E "s/ \(MOEBUS[^)]*\)//" | tr '\n' ' ' | cut -c1-240; echo
echo "time-slice policy: $(timeout 5 nvidia-smi compute-policy -l 2>&1 | grep -oE "Timeslice +[A-Za-z]+" | head -1)"
echo "== vis17 summary at ${SECONDS} s (summary_<tag>.txt, capture_<tag>.txt, gap_parts.txt, gap12.txt, the logs)"
for run in $RUNS; do  # the call's tail: ~650 characters a run
  tag=${run%%:*}; L=$OUT/cycle_budget256_$tag.log.gz
  [ -f $L ] || { echo "$tag: no log (not run)"; continue; }
  timeout 10 python3 tools/device/vis18_capture.py $L --tag $tag --short --min-beside 3 2>&1 | head -2 | cut -c1-250
  head -2 $OUT/summary_$tag.txt | awk '{print substr($0, 1, NR < 2 ? 120 : 250)}'
done
echo "== vis17 done at ${SECONDS} s"
