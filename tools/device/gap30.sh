#!/usr/bin/env bash
# One H200 (thirtieth session; issue 20). The cold image's largest gap has been 2.0-2.6x the streams' median over the
# cycle for five sessions while the steady window before the image (48 gaps, no image) already held 1.6-2.9x: is the
# rest the image or the text's own tail? bench vision-cycle now decodes --control-tokens (256, about the cold start's
# steps until encoded) with no image before its steady window and prints that window's largest gap against the same
# medians. One call (~8 min): gap25.sh's cycle (ROUTE=0) over
#   def, def2, def3   the defaults (with the image-free window);
#   p1, p12           MOEBUS_ADMISSION_PEAK=1 (a step's misses + admissions within 1x the typical misses, not 2x:
#                     the steady logs alternate ~2 and ~6 ms steps, the slow ones beside the admissions' copies);
#   old               --control-tokens=0 (the image at the streams' 32nd token, as in the sessions before).
#   bash tools/device/gap30.sh 2>&1 | tail -40      (carry .whl)
source tools/device/setup.sh
FINAL=$OUT
L=MOEBUS_LOG_STEPS=1,MOEBUS_LOG_GC_MS=2
OUT=$FINAL ROUTE=0 MEASURE_S=${MEASURE_S:-300} \
  VIS_RUNS=${VIS_RUNS:-"def:$L p1:$L,MOEBUS_ADMISSION_PEAK=1 def2:$L p12:$L,MOEBUS_ADMISSION_PEAK=1 def3:$L old:$L,CYCLE_ARGS=--control-tokens=0"} \
  bash tools/device/gap25.sh 2>&1 | grep -vE "^(===|-150)" | grep -E "ratios|starts|bins|done|rc=|Error|error" | tail -30
for f in $FINAL/cycle_budget256_*.log.gz; do
  tag=$(basename $f .log.gz); tag=${tag#cycle_budget256_}
  echo "$tag: $(zcat $f | grep -E "^text streams' largest gap" | grep -oE '(encode|last token|before it) / their (median (before|over the cycle)|largest without an image) \(worst stream\): [0-9.]+' \
    | sed -E 's/ \(worst stream\)//; s/their median //; s/their largest without an image/alone/' | tr '\n' ';')"
  echo "$tag: $(zcat $f | grep -E "an image-free window before it|steady state before the image" | sed -E 's/^ *//' | cut -c1-120 | tr '\n' ' ')"
done
echo "== gap30 done at ${SECONDS} s"
