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
export VIS_RUNS=${VIS_RUNS:-"off:$LOGS s2cap:$LOGS,$S=2,$CAP,MOEBUS_TOWER_SLICE_PAUSE_MS=0 s4cap:$LOGS,$S=4,$CAP,MOEBUS_TOWER_SLICE_PAUSE_MS=0 s2p4:$LOGS,$S=2,$CAP,MOEBUS_TOWER_SLICE_PAUSE_MS=4 s1:$LOGS,$S=1,MOEBUS_TOWER_SLICE_WHEN=busy,MOEBUS_TOWER_SLICE_PAUSE_MS=4"}
PHASE=warm BUDGET=${WARM_S:-115} bash tools/device/gap17.sh
echo "== warm done at ${SECONDS} s"
PHASE=measure BUDGET=${MEASURE_S:-260} bash tools/device/vis17.sh
echo "== encode lines (the measured cold start is encode 2)"
for run in $VIS_RUNS; do
  tag=${run%%:*}; L=$OUT/cycle_budget256_$tag.log.gz
  [ -f $L ] && zcat $L | grep -E "encode [0-9]+:" | sed -E "s/^.*(encode [0-9]+:)/$tag \1/" | head -3 | cut -c1-230
done
