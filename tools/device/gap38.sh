#!/usr/bin/env bash
# One GPU (thirty-fifth session; issue 20). gap36/gap37 on H100s: the text's slowest decode steps through the cold
# image's start (12-28 ms against ~3) fall in the vision worker's "pinned copy" of the streamed tower's 785 MiB
# (cuMemHostAlloc, then a threaded fill; 350-540 ms), and in its first encode's cuBLAS module loads. Which part of
# the pinned copy: the page locking and mapping, or the fill? MOEBUS_VISION_STREAM_HOST=register pins the zygote's
# packed weights in place (cuMemHostRegister: the locking and mapping, no allocation, no fill). One call (~5.5 min):
# gap17.sh's warm phase, then the cycle (8 x 128 A3B LLaVA so400m at --gpu-memory-mib 8192, 2 text streams, cold
# start 2 of 2) over reg, def, reg2, def2.
#   bash tools/device/gap38.sh 2>&1 | tail -40      (carry .whl)
L=MOEBUS_LOG_STEPS=1,MOEBUS_LOG_GC_MS=2
R=$L,MOEBUS_VISION_STREAM_HOST=register
VIS_RUNS=${VIS_RUNS:-"reg:$R def:$L reg2:$R def2:$L"} MEASURE_S=${MEASURE_S:-150} bash tools/device/gap35.sh 2>&1 \
  | grep -v "^2 passed\|NAT =\|^-- Docs\|^\s*$\|MPS control"
for f in $OUT/cycle_budget256_*.log.gz; do
  echo "$(basename $f): $(zcat $f | grep -oE "on the host: [a-z -]+ in [0-9]+ ms" | tr '\n' ';')"
done
