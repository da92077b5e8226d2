#!/usr/bin/env bash
# One H200, issue 20 item 3 (eleventh session, branch gap11): what a spanning chunk's step spends its
# time on, with the chunk's work a step bounded by time (MOEBUS_CHUNK_TIME_SHARE, default 0.5 of the
# decode rows' time). gap10.sh's cycle (the 8 x 128 A3B LLaVA (so400m) under --gpu-memory-mib 8192,
# 2 text streams, --max-batch 4, cold start 2 of 2, copy budget 256 MiB) beside its GPU tests
# (test_spanning_chunk, with the time-bounded case, and test_host_tiles) and the model's build, the
# worker's steps traced by CUPTI from the chunk's second step until the image's request is over
# (MOEBUS_TRACE_CHUNK_STEPS, workers/step_trace.py: the profiler's stop falls after the image's last
# token, outside the gaps' window; its start, logged, inside), then the trace by step, kind and part
# (tools/device/gap11_trace.py) and the chunks' host time by part. Then, while BUDGET allows, the same
# cycle untraced at each share of SHARES (0: the copy budget alone, the tenth session's steps).
#   BUDGET=145 bash tools/device/gap11.sh     (timeout_s 155: the model's build ~40 s, the traced cycle ~85-95 s on a
#                                             fresh kernel cache; TRACE_STEPS=0: untraced)
# As run (16:38, BUDGET=110): GPU tests 6 passed, the model built at 40 s, the cycle killed at its 70 s before the
# measured cold start (the worker's start alone took 54 s: 27 s to the host store, 14 s of graphs, 7 s torch).
set -o pipefail
BUDGET=${BUDGET:-145}
export MOEBUS_TRACE_DIR=$OUT
parts() {  # the chunks' "done" lines: steps, step times, host time by part
  grep -hoE "a prompt chunk of [0-9]+ tokens .* done in .*" $OUT/cycle_*_$1.log | \
    sed -E 's/ \(slot [0-9]+, from [0-9]+\)//; s/, host time to its reply, with the decode rows//' | cut -c1-700
}
echo "== 1. bounded by time (share ${MOEBUS_CHUNK_TIME_SHARE:-0.5}), traced (at ${SECONDS} s)"
MOEBUS_TRACE_CHUNK_STEPS=${TRACE_STEPS:-400} FIRST_CAP=100 TAG=traced BUDGETS=256 BUDGET=$BUDGET bash tools/device/gap10.sh
parts traced
grep -hE "steps traced to|no step trace|a trace of|trace started" $OUT/cycle_*_traced.log | sed -E 's/^.*(gpu0: )/\1/' \
  | cut -c1-200
if [ -f $OUT/chunk_trace_gpu0.json ]; then
  timeout 30 python3 tools/device/gap11_trace.py $OUT/chunk_trace_gpu0.json
  gzip -f $OUT/chunk_trace_gpu0.json
fi
for share in ${SHARES:-0}; do
  left=$((BUDGET - SECONDS))
  echo "== 2. share $share, untraced (at ${SECONDS} s, ${left} s left)"
  if [ $left -gt 35 ]; then
    MOEBUS_CHUNK_TIME_SHARE=$share SKIP_TESTS=1 TAG=share$share BUDGETS=256 BUDGET=$left bash tools/device/gap10.sh
    parts share$share
  else
    echo "not run: ${SECONDS} s spent"
  fi
done
echo "== gap11 done at ${SECONDS} s"
