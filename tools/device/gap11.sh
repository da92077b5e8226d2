#!/usr/bin/env bash
# One H200, issue 20 item 3 (eleventh session, branch gap11): what a spanning chunk's step spends its
# 40-60 ms on, and the chunk's work bounded by time. gap10.sh's cycle twice (the 8 x 128 A3B LLaVA
# (so400m) under --gpu-memory-mib 8192, 2 text streams, --max-batch 4, cold start 2 of 2, copy budget
# 256 MiB):
#  1. with the copy budget alone (MOEBUS_CHUNK_TIME_SHARE=0: the tenth session's steps), the worker's
#     steps traced by CUPTI (MOEBUS_TRACE_CHUNK_STEPS: from the chunk's second step, its steps and the
#     steps between; workers/step_trace.py), beside gap10.sh's GPU tests (test_spanning_chunk, with the
#     time-bounded case, and test_host_tiles) and the model's build; then the trace by step and by part
#     (tools/device/gap11_trace.py);
#  2. with the chunk's work a step bounded by a share of the decode rows' time (MOEBUS_CHUNK_TIME_SHARE,
#     each of SHARES while BUDGET allows: 0.5, the default, then 1), untraced.
# Each: the bench's rows and gaps, the workers' phase lines, the chunks' steps, their host time by part.
#   BUDGET=175 bash tools/device/gap11.sh     (timeout_s 190; ~250-265 s of device time with the start)
set -o pipefail
BUDGET=${BUDGET:-175}
export MOEBUS_TRACE_DIR=$OUT
parts() {  # the chunks' "done" lines: steps, step times, host time by part
  grep -hoE "a prompt chunk of [0-9]+ tokens .* done in .*" $OUT/cycle_*_$1.log | \
    sed -E 's/ \(slot [0-9]+, from [0-9]+\)//; s/, host time to its reply, with the decode rows//' | cut -c1-700
}
echo "== 1. copy budget alone, traced (at ${SECONDS} s)"
MOEBUS_CHUNK_TIME_SHARE=0 MOEBUS_TRACE_CHUNK_STEPS=16 TAG=traced BUDGETS=256 BUDGET=$((BUDGET - 40)) \
  bash tools/device/gap10.sh
parts traced
grep -hE "steps traced to|no step trace|a trace of" $OUT/cycle_*_traced.log | sed -E 's/^.*(gpu0: )/\1/' | cut -c1-200
if [ -f $OUT/chunk_trace_gpu0.json ]; then
  timeout 40 python3 tools/device/gap11_trace.py $OUT/chunk_trace_gpu0.json
  gzip -f $OUT/chunk_trace_gpu0.json
fi
for share in ${SHARES:-0.5 1}; do
  left=$((BUDGET - SECONDS))
  echo "== 2. bounded by time, share $share (at ${SECONDS} s, ${left} s left)"
  if [ $left -gt 35 ]; then
    MOEBUS_CHUNK_TIME_SHARE=$share SKIP_TESTS=1 TAG=share$share BUDGETS=256 BUDGET=$left bash tools/device/gap10.sh
    parts share$share
  else
    echo "not run: ${SECONDS} s spent"
  fi
done
echo "== gap11 done at ${SECONDS} s"
