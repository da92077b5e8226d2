#!/usr/bin/env bash
# One H200, issue 20 (fifteenth session, branch gap15): what the text streams' largest gaps through a cold
# LLaVA image are made of, and whether the session's new defaults help that cycle. gap12.sh's cycle (gap10.sh's:
# the 8 x 128 A3B LLaVA (so400m) under --gpu-memory-mib 8192, 2 text streams, cold start 2 of 2, copy budget
# 256 MiB) in two runs "tag:VAR=value,VAR=value", each with MOEBUS_LOG_STEPS=1 (the worker logs every step's
# time and the wait before it; an INFO that held a step and a step that came late are logged anyway) and
# MOEBUS_LOG_GC_MS=2 (a garbage collection over 2 ms in the worker, the broker or the bench's client is logged):
#   default    the tree's defaults (integ15 + gap15: image steps of 2048 tokens, PDL programmatic + trigger, each
#              process's start objects frozen out of the collector (MOEBUS_GC_FREEZE), an INFO right after a VRAM
#              reserve without driver calls (MOEBUS_INFO_AT_RESERVE))
#   step0      MOEBUS_IMAGE_STEP_TOKENS=0: the image prompt in chunks of max_step_tokens (510 + 246) instead of one
#              756-token chunk (call A's default run was cut by its cap before its prefill ended)
# (call A, 08:28 UTC: "default" with the integ15 defaults, and "trial": MOEBUS_PDL=0 MOEBUS_IMAGE_STEP_TOKENS=0
# MOEBUS_GC_FREEZE=1; RUNS="..." runs any such list.)
# Then, per run, each of the 3 largest gaps with the worker's lines stamped in it (tools/device/gap15_gaps.py),
# and last a short summary (the call's tail): the ratios, the phases of the 3 largest gaps, what was in them.
#   PHASE=warm     gap12.sh's warm phase (its model at /tmp/gap-a3b-8x128-vision, ~12 GB on disk; the GPU tests
#                  of the spanning chunk and HostTiles; one compiling cycle)
#   PHASE=measure  the runs (RUN_CAP s each at most, 44: the defaults first; step0 only where 34 s are left;
#                  call A: 30 s with the freeze, over 36 s without (a fresh process's first prompt steps took 7.5 + 5.4 s))
#   PHASE=measure BUDGET=76 bash tools/device/gap15.sh
source tools/device/setup.sh
set -o pipefail
BUDGET=${BUDGET:-76}
export V=${V:-/tmp/gap-a3b-8x128-vision}
if [ "$PHASE" = warm ]; then
  PHASE=warm BUDGET=$BUDGET bash tools/device/gap12.sh
  exit 0
fi
LOG=MOEBUS_LOG_STEPS=1,MOEBUS_LOG_GC_MS=2
RUNS=${RUNS:-default:$LOG step0:$LOG,MOEBUS_IMAGE_STEP_TOKENS=0}
RUNS="$RUNS" RUN_CAP=${RUN_CAP:-44} BUDGET=$((BUDGET - 3)) bash tools/device/gap12.sh
logs=$(ls $OUT/cycle_budget256_*.log.gz 2>/dev/null)
for L in $logs; do  # every line the workers stamped in each of the largest gaps (the steps' too)
  echo "--- $(basename $L .log.gz)"; timeout 10 python3 tools/device/gap15_gaps.py $L --count 5 | cut -c1-220 | head -60
done > $OUT/gap_parts.txt 2>&1
echo "== gap15 summary at ${SECONDS} s (the whole of each run above and in gap_parts.txt)"
for run in $RUNS; do
  tag=${run%%:*}; L=$OUT/cycle_budget256_$tag.log.gz
  if [ -f $L ]; then timeout 10 python3 tools/device/gap15_gaps.py $L --summary "$tag" | cut -c1-330
  else echo "$tag: no log (not run)"; fi
done
echo "== gap15 done at ${SECONDS} s"
