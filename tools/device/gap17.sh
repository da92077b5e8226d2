#!/usr/bin/env bash
# One H200, issue 20 (seventeenth session, branch gap17, second round): the image prompt's chunk steps within ~11 ms
# (2x the text streams' median). Call A (seventeenth session): with the held chunk's switches on (now the
# defaults: MOEBUS_KEEP_HELD_FEED, MOEBUS_HELD_CHUNK_AHEAD) a chunk step waited 0.18 ms, but the chunk's steps took
# 10.1 / 14.1 / 28.9 ms (min / median / max; 38 of 41 over 11 ms): MOEBUS_CHUNK_TIME_SHARE=0.5 is a share of the
# decode rows' time, and the rows beside the chunk took ~10 ms (43 misses a step over PCIe); the decode-only steps
# between them took a median 11.4 ms too (25 of 40 over 11). New switch (off by default):
#   MOEBUS_CHUNK_STEP_MS=11  (workers/spanning_chunk.py STEP_MS) a chunk step's work ends by 11 ms after the step's
#                            start, whatever the share allows; a chunk's first step whose decode rows ran
#                            synchronously does no chunk work (its loan and setup go to the next step, beside the
#                            rows' launched graph). Bits unchanged (tests/workers/test_spanning_chunk.py).
# gap16.sh's cycle (the 8 x 128 A3B LLaVA (so400m) at /tmp/gap-a3b-8x128-vision, --gpu-memory-mib 8192, 2 text
# streams, cold start 2 of 2, copy budget 256 MiB) with every step logged (MOEBUS_LOG_STEPS=1), collections
# (MOEBUS_LOG_GC_MS=2) and slow decodes of the link (MOEBUS_LOG_DECODE_MS=1).
#   PHASE=warm     the model (marker .gap12-ready; ~40 s) and one cycle cut at BUDGET that fills the kernel
#                  cache. Beside other branches the budget comes from the driver's free memory: it waits (up to
#                  10 s) for 12 GiB free, then tries --gpu-memory-mib 8192, and after a failure within 40 s 6144,
#                  then 4096 (each after up to 8 s waiting for 4 GiB more than it free). ~115 s.
#   PHASE=measure  RUNS in turn ("tag:VAR=v,..."), each where 34 s are left, at most RUN_CAP s (45): "ahead"
#                  (the defaults: both held-chunk switches on), "wide" (the same at --gpu-memory-mib 12288 (GPU_MIB, read
#                  by gap10.sh / gap12.sh): a cache that holds every expert idle and ~90% of them beside the vision
#                  worker, so the decode rows' misses no longer dominate), "bounded" (+ MOEBUS_CHUNK_STEP_MS=11), "share025"
#                  (+ MOEBUS_CHUNK_TIME_SHARE=0.25; runs only at BUDGET >= ~105); then per run gap17_waits.py (the
#                  wait before chunk steps, the chunk steps' own ms), gap15_gaps.py's summary (ratios, largest gaps
#                  and what was in them) and gap17_steps.py (chunk steps against decode-only steps in the prefill:
#                  n / median / p90 / max / over 11 ms). ~30 s a run.
#   PHASE=measure BUDGET=95 bash tools/device/gap17.sh
source tools/device/setup.sh
set -o pipefail
BUDGET=${BUDGET:-95}
export V=${V:-/tmp/gap-a3b-8x128-vision}
LOGS=MOEBUS_LOG_STEPS=1,MOEBUS_LOG_GC_MS=2,MOEBUS_LOG_DECODE_MS=1
NEW=MOEBUS_KEEP_HELD_FEED=1,MOEBUS_HELD_CHUNK_AHEAD=1
free_mib() { nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits 2>/dev/null | head -1 | tr -dc 0-9; }
wait_free() {  # MiB, at most s: until the driver shows that much free (the worker's budget is min(cap, free))
  local f i; for i in $(seq $2); do f=$(free_mib); { [ -z "$f" ] || [ "$f" -ge $1 ]; } && return; sleep 1; done
}
if [ "$PHASE" = warm ]; then
  [ -f $V/.gap12-ready ] || { rm -rf $V; timeout $((BUDGET - 50)) python3 -m moebus.cli init-model $V --preset a3b \
    --layers 8 --vision siglip > $OUT/init.log 2>&1 && touch $V/.gap12-ready; }
  echo "model at ${SECONDS} s: $(du -sh $V 2>/dev/null | cut -f1) ($(tail -1 $OUT/init.log 2>/dev/null | cut -c1-120))"
  for mib in 8192 6144 4096; do  # compiles into the disk cache (no figure: other branches run beside)
    wait_free $((mib + 4096)) $([ $mib = 8192 ] && echo 10 || echo 8)
    echo "GPU free at ${SECONDS} s: $(free_mib) MiB"
    left=$((BUDGET - SECONDS - 8)); [ $left -lt 25 ] && { echo "no warm cycle at $mib MiB: ${left} s left"; break; }
    L=$OUT/warm_cycle_$mib.log; began=$SECONDS
    env ${LOGS//,/ } ${NEW//,/ } MOEBUS_MAX_PREFILL_COPY_MIB_BESIDE_DECODE=256 timeout $left python3 -m moebus.cli \
      bench vision-cycle --device cuda --model $V --gpu-memory-mib $mib -v --idle-s 1 --repeats 1 --text-streams 2 \
      --cold-starts 2 --max-batch 4 --timeout-s 90 --skip-resident > $L 2>&1
    rc=$?; took=$((SECONDS - began))
    echo "warm cycle at $mib MiB: rc=$rc in $took s; ERROR lines $(grep -c ERROR $L), tracebacks $(grep -c Traceback $L)"
    grep -hE "kernels: .* compiled" $L | sed -E 's/^.*INFO //' | cut -c1-160 | head -3
    grep -m1 -A8 Traceback $L | cut -c1-200
    timeout 10 python3 tools/device/gap17_waits.py $L --tag warm$mib | cut -c1-300
    gzip -f $L
    [ $rc = 0 ] || [ $took -ge 40 ] && break  # done, or cut by its time: the kernels it reached are cached
  done
  exit 0
fi
[ -f $V/.gap12-ready ] || { echo "no model at $V (the warm phase did not finish it)"; exit 1; }
RUNS=${GAP_RUNS:-${RUNS:-ahead:$LOGS wide:$LOGS,GPU_MIB=12288 bounded:$LOGS,MOEBUS_CHUNK_STEP_MS=11 share025:$LOGS,MOEBUS_CHUNK_TIME_SHARE=0.25}}
echo "GPU free: $(free_mib) MiB"
RUNS="$RUNS" RUN_CAP=${RUN_CAP:-45} BUDGET=$((BUDGET - 8)) bash tools/device/gap15.sh > $OUT/gap15.txt 2>&1
grep -E "^=== |^rc=|not run" $OUT/gap15.txt | sed -E "s/ \(MOEBUS[^)]*\)//" | cut -c1-100
for run in $RUNS; do  # the whole of each run's reading, into $OUT/summary_<tag>.txt
  tag=${run%%:*}; L=$OUT/cycle_budget256_$tag.log.gz
  [ -f $L ] || continue
  { timeout 10 python3 tools/device/gap17_waits.py $L --tag $tag
    timeout 10 python3 tools/device/gap15_gaps.py $L --summary "$tag"
    timeout 10 python3 tools/device/gap17_steps.py $L --tag $tag
    echo "ERROR lines $(zcat $L | grep -c ERROR); chunks done $(zcat $L | grep -c 'prompt chunk of .* done in'), dropped $(zcat $L | grep -c 'prompt chunk of .* dropped')"
    zcat $L | grep -E "prompt chunk of .* (done in|dropped)" | sed -E 's/^.*(a prompt chunk)/\1/'
  } > $OUT/summary_$tag.txt 2>&1
done
echo "== gap17 summary at ${SECONDS} s (each run whole in summary_<tag>.txt; gap15.txt, gap_parts.txt)"
for run in $RUNS; do  # the call's tail: ~600 characters a run
  tag=${run%%:*}; S=$OUT/summary_$tag.txt
  [ -f $S ] || { echo "$tag: not run"; continue; }
  head -1 $S | cut -c1-190; sed -n 3,4p $S | cut -c1-190; grep -m1 " prefill steps: " $S | cut -c1-190
  grep -m1 "^a prompt chunk of .* done in" $S | sed -E 's/ \(min .*//; s/ \(slot [0-9]+, from [0-9]+\)//' | cut -c1-130
  grep -m1 "^ERROR lines" $S
done
echo "== gap17 done at ${SECONDS} s"
