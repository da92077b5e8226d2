#!/usr/bin/env bash
# One H200 (the thirty-third session's plan, written in the thirty-second; issue 20). The thirty-second measured on
# an H100 (gap31.sh, def / m16s / def2): a lazy vision start's first encode takes 244.0 MiB more than the start
# (128.4 reckoned; the worker then holds 602-604 MiB, the next hand-back 666-668), 18 MiB segments make a 64 MiB
# hand-back request 3.5-3.8 ms (4.9-6.7 with 2 MiB). It made segment_mib 0 and a 16 MiB margin the defaults and
# reckons the first encode's loads (116 MiB) in the first reserve. One call (~7.5 min):
#   1. ctx31.py (now importing numba.cuda through compat), the streamed tower's and the footprint's GPU tests;
#   2. the cycle over def, def2, def3 (the new defaults), prev (MOEBUS_SEGMENT_MIB=2, margin 64: the thirty-first
#      session's defaults, with the loads reckoned) and ws4 (MOEBUS_CUBLAS_WORKSPACE_MB=4 for every worker: how much
#      of the 244 MiB is cuBLAS's workspace, and what it costs the text's steps);
#   3. the footprint lines and the preload's own (vision_preload.LoadBeside: cuBLAS's start and the kernels' modules,
#      each with the MiB it took: which part of the 116 MiB beyond the arrays is which).
# To read: "encode / alone" (the image's own share, H200 1.11-1.23 in the thirtieth) and until encoded / cycle
# against the control's spread; the slots through the image (718 with 552 reserved; now ~632 + the reckoned start).
#   bash tools/device/gap32.sh 2>&1 | tail -60      (carry .whl)
L=MOEBUS_LOG_STEPS=1,MOEBUS_LOG_GC_MS=2
export UNMAP=${UNMAP:-0} MEASURE_S=${MEASURE_S:-260}
export VIS_RUNS=${VIS_RUNS:-"def:$L def2:$L prev:$L,MOEBUS_SEGMENT_MIB=2,MOEBUS_VISION_RESERVE_MARGIN_MIB=64 ws4:$L,MOEBUS_CUBLAS_WORKSPACE_MB=4 def3:$L"}
bash tools/device/gap31.sh 2>&1 | tail -45
for f in $OUT/cycle_budget256_*.log.gz; do  # what the preload beside the first encode took, by part
  echo "$(basename $f): $(zcat $f | grep -oE 'vision preload beside: .*' | cut -c1-200 | tr '\n' ';')"
done
echo "== gap32 done at ${SECONDS} s"
