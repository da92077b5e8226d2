#!/usr/bin/env bash
# One H200, issue 20 (fourteenth session, branch gap14): the text streams' largest gap through a cold
# LLaVA image. gap12.sh's cycle (gap10.sh's: the 8 x 128 A3B LLaVA (so400m) under --gpu-memory-mib 8192,
# 2 text streams, cold start 2 of 2, copy budget 256 MiB; the defaults: the overlap and gap13's three on)
# in runs "tag:VAR=value,VAR=value":
#   staged16     the chunk's misses copied into 16 staging slots of its loan, not admitted into the cache
#                (spanning_chunk_staging.py, MOEBUS_CHUNK_STAGING_SLOTS=16; off by default until measured):
#                call 2's decode rows missed ~32 experts a step beside the chunks against ~15 before
#   default      call 2's default (staging off)
#   staged16plan staging, and a group that makes its layer's plan after the layer's entry in one step only where
#                the last such group's host time fits (chunk_advance.PLAN_HOST, MOEBUS_CHUNK_PLAN_HOST=1; off by
#                default): call 2's slowest steps (14-16 ms) were a layer's entry and then its first group
# Read: the "prefill" row's misses a step (the caches' column), the largest gap / median, the first token.
# Then, with what is left, the staged cases of tests/cuda/test_spanning_chunk.py (all of it runs in the warm phase).
#   PHASE=warm     gap12.sh's warm phase (its model at /tmp/gap-a3b-8x128-vision, ~12 GB on disk; the GPU tests
#                  of the spanning chunk and HostTiles; one compiling cycle)
#   PHASE=measure  the runs (RUN_CAP s each at most)
#   PHASE=measure BUDGET=96 bash tools/device/gap14.sh
source tools/device/setup.sh
set -o pipefail
BUDGET=${BUDGET:-96}
export V=${V:-/tmp/gap-a3b-8x128-vision}
if [ "$PHASE" = warm ]; then
  PHASE=warm BUDGET=$BUDGET bash tools/device/gap12.sh
  exit 0
fi
S16=MOEBUS_CHUNK_STAGING_SLOTS=16
RUNS=${RUNS:-staged16:$S16 default:MOEBUS_CHUNK_STAGING_SLOTS=0 staged16plan:$S16,MOEBUS_CHUNK_PLAN_HOST=1}
RUNS="$RUNS" RUN_CAP=${RUN_CAP:-36} BUDGET=$BUDGET bash tools/device/gap12.sh
for L in $OUT/cycle_budget256_*.log.gz; do  # each chunk's copies, last step, release and staging slots
  [ -f "$L" ] || continue
  echo "  $(basename $L .log.gz): $(zgrep -ho 'done in [0-9]* steps, [0-9]* experts copied in\|staging slots [0-9]*' $L | tr '\n' ';')"
done
left=$((BUDGET - SECONDS))
echo "=== staged GPU tests at ${SECONDS} s, ${left} s left"
if [ $left -ge 12 ]; then
  MOEBUS_TEST_GPU=1 timeout $((left - 1)) python3 -m pytest -q -p no:cacheprovider tests/cuda/test_spanning_chunk.py \
    -k "True-2 or False-2" > $OUT/gpu_tests_staged.log 2>&1
  echo "staged GPU tests rc=$?"; grep -E "passed|failed|Error" $OUT/gpu_tests_staged.log | tail -3 | cut -c1-200
else
  echo "not run (the warm phase's gpu_tests.log has them)"
fi
echo "== gap14 done at ${SECONDS} s"
