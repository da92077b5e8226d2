#!/usr/bin/env bash
# One H200, issue 20 (thirteenth session, branch gap13): the text streams' largest gap through a cold
# LLaVA image. gap12.sh's cycle (gap10.sh's: the 8 x 128 A3B LLaVA (so400m) under --gpu-memory-mib 8192,
# 2 text streams, cold start 2 of 2, copy budget 256 MiB) in runs "tag:VAR=value,VAR=value":
#   new        the decode rows overlapped (MOEBUS_CHUNK_OVERLAP=1) with this branch's changes on (each off
#              by default until measured; ON below): the dense products warmed at every row count (moe_prefill.warm_dense,
#              MOEBUS_WARM_DENSE_ROWS=1024), a later group only where its host time fits
#              (chunk_advance.GROUP_HOST, MOEBUS_CHUNK_GROUP_HOST=1) and a chunk's first step ended after
#              its setup where layer 0's entry does not fit (chunk_advance.SETUP_STEP, MOEBUS_CHUNK_SETUP_STEP=1)
#   default    call 1's default: no overlap, none of the three
#   overlap    call 1's overlap: none of the three
#   nooverlap  the changes without the overlap (run where the budget allows)
# then tools/device/gap13_probe.py (~10 s): a decode-like step's parts (mapped reads over PCIe, SM work,
# a copy-engine copy; host time) while a second process creates its context, uploads 800 MiB and runs
# kernels, as the vision worker's start does beside the language worker.
#   PHASE=warm     gap12.sh's warm phase (its model at /tmp/gap-a3b-8x128-vision, ~10 GB; the GPU tests of
#                  the spanning chunk and HostTiles; one compiling cycle, the overlap on)
#   PHASE=measure  the runs (RUN_CAP s each at most), then the probe
#   PHASE=measure BUDGET=105 bash tools/device/gap13.sh
source tools/device/setup.sh
set -o pipefail
BUDGET=${BUDGET:-105}
export V=${V:-/tmp/gap-a3b-8x128-vision}
if [ "$PHASE" = warm ]; then
  PHASE=warm BUDGET=$BUDGET bash tools/device/gap12.sh
  exit 0
fi
PROBE_S=${PROBE_S:-14}
OFF=MOEBUS_WARM_DENSE_ROWS=0,MOEBUS_CHUNK_GROUP_HOST=0,MOEBUS_CHUNK_SETUP_STEP=0
ON=MOEBUS_WARM_DENSE_ROWS=1024,MOEBUS_CHUNK_GROUP_HOST=1,MOEBUS_CHUNK_SETUP_STEP=1
RUNS=${RUNS:-new:MOEBUS_CHUNK_OVERLAP=1,$ON default:MOEBUS_CHUNK_OVERLAP=0,$OFF overlap:MOEBUS_CHUNK_OVERLAP=1,$OFF nooverlap:MOEBUS_CHUNK_OVERLAP=0,$ON}
RUNS="$RUNS" RUN_CAP=${RUN_CAP:-40} BUDGET=$((BUDGET - PROBE_S)) bash tools/device/gap12.sh
for L in $OUT/cycle_budget256_*.log.gz; do  # the dense warm-up at the worker's start; each chunk's last step and release
  [ -f "$L" ] || continue
  zgrep -hm1 "dense products warmed" $L | sed -E "s/^.*INFO /  $(basename $L .log.gz): /" | cut -c1-200
  echo "  $(basename $L .log.gz): chunks' $(zgrep -ho 'its last step [0-9.]* ms, then its release [0-9.]* ms' $L | tr '\n' ';')"
done
left=$((BUDGET - SECONDS))
echo "=== probe at ${SECONDS} s, ${left} s left"
if [ $left -ge 11 ]; then
  timeout $((left - 1)) python3 tools/device/gap13_probe.py --seconds $(( left > 16 ? 8 : left - 8 )) --lead-s 1.5 \
    > $OUT/probe.txt 2>&1
  echo "probe rc=$?"
  cut -c1-400 $OUT/probe.txt | tail -14
else
  echo "probe not run: ${left} s left"
fi
echo "== gap13 done at ${SECONDS} s"
