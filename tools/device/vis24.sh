#!/usr/bin/env bash
# One H200, issue 20 (twenty-fourth session): the tower in slices beside the text streams, measured at last.
# vis17 built MOEBUS_TOWER_SLICE_LAYERS (workers/tower_slices.py) but its runs were cut before the image (call A)
# and the second round measured the capture instead: the encode phase's largest gap stayed 15.9-18.5 ms against a
# 5.5 ms median before the image (the two contexts time-sliced while the eager tower's ~300 launches arrive one by
# one beside the decode steps). One call: gap17.sh's warm phase (the model, one cycle that fills the kernel cache),
# then vis17.sh's measure with RUNS (default below): off, s2cap (2 layers a slice, captured and launched by slice,
# no pause, the NVML gate), s4cap (4 layers), s2p4 (s2cap with 4 ms pauses), s1 (eager, 1 layer, 4 ms pauses).
#   WARM_S=115 MEASURE_S=260 bash tools/device/vis24.sh
source tools/device/setup.sh
LOGS=MOEBUS_LOG_STEPS=1,MOEBUS_LOG_GC_MS=2
S=MOEBUS_TOWER_SLICE_LAYERS
CAP=MOEBUS_TOWER_SLICE_CAPTURE_FIRST=1,MOEBUS_TOWER_SLICE_WHEN=busy
S2=$S=2,$CAP,MOEBUS_TOWER_SLICE_PAUSE_MS=0
# call A (the first round: s2cap / s4cap / s2p4 died in their capture, fixed since; s1 did not help) ran
#   off s2cap s4cap s2p4 s1:$LOGS,$S=1,MOEBUS_TOWER_SLICE_WHEN=busy,MOEBUS_TOWER_SLICE_PAUSE_MS=4
# call B: off, the capture-first slices of 2 and 4 layers, then s2cap with hand-back steps of 32 MiB (hb32), and
# s2cap at a 10.5 GiB budget (wide: every expert fits idle, ~85% beside the vision worker: the stall part of the gaps)
export VIS_RUNS=${VIS_RUNS:-"off:$LOGS s2cap:$LOGS,$S2 s4cap:$LOGS,$S=4,$CAP,MOEBUS_TOWER_SLICE_PAUSE_MS=0 hb32:$LOGS,$S2,MOEBUS_VISION__HANDBACK_STEP_MIB=32 wide:$LOGS,$S2,GPU_MIB=10752"}
if [ -n "$TESTS" ]; then  # the GPU tests of the change (the capture fix: test_tower_slices.py, test_backend.py)
  MOEBUS_TEST_GPU=1 timeout ${TESTS_S:-60} python3 -m pytest -q -p no:cacheprovider -rf --tb=short -W ignore $TESTS \
    > $OUT/gpu_tests.log 2>&1
  echo "GPU tests rc=$? at ${SECONDS} s: $(tail -1 $OUT/gpu_tests.log | cut -c1-150)"; grep -E "^FAILED|Error" $OUT/gpu_tests.log | head -5 | cut -c1-200
fi
PHASE=warm BUDGET=${WARM_S:-115} bash tools/device/gap17.sh
echo "== warm done at ${SECONDS} s"
PHASE=measure BUDGET=${MEASURE_S:-260} bash tools/device/vis17.sh
echo "== encode lines (the measured cold start is encode 2)"
for run in $VIS_RUNS; do
  tag=${run%%:*}; L=$OUT/cycle_budget256_$tag.log.gz
  [ -f $L ] || continue
  zcat $L | grep -E "encode [0-9]+:" | sed -E "s/^.*(encode [0-9]+:)/$tag \1/" | tail -1 | cut -c1-230
  zcat $L | grep -E "Traceback|ERROR" | head -2 | cut -c1-200
  zcat $L | grep -E "VRAM [0-9.]+:" | tail -24 | sed -E 's/^.*VRAM/VRAM/' | awk 'NR % 6 == 1' | cut -c1-200
done
