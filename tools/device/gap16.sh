#!/usr/bin/env bash
# One H200, issue 20 (sixteenth session, branch gap16): the default cold LLaVA cycle to its end, and what a fresh
# GPU worker's first prompt steps spend their seconds on (the fifteenth session's: 2.4-7.5 s each, which cut
# its default runs). gap12.sh's cycle (the 8 x 128 A3B LLaVA (so400m) at /tmp/gap-a3b-8x128-vision, ~12 GB on
# disk, under --gpu-memory-mib 8192, 2 text streams, cold start 2 of 2, copy budget 256 MiB) with every step
# logged (MOEBUS_LOG_STEPS=1), long collections (MOEBUS_LOG_GC_MS=2) and a step running over 0.5 s sampled:
# its innermost frames, then the kernels loaded / compiled in it by name (MOEBUS_STEP_STACKS_S=0.5,
# workers/step_watch.py), read by tools/device/gap16_first_use.py, and each message the worker's link took over
# 1 ms to decode (MOEBUS_LOG_DECODE_MS=1: in call A a chunk's step waited 3.5-4.9 ms before it, carrying its feed
# again). The tree's kernel cache keys hold across processes now (MOEBUS_STABLE_KERNEL_KEYS=1, kernel_cache.py):
# every start line should say "0 compiled" (call A: 43 loaded, 0 compiled).
#   PHASE=warm     the model (gap12.sh's, its marker .gap12-ready) and one such cycle cut at BUDGET (120): it
#                  compiles the kernels into the disk cache; its slow steps show what a compile costs there (call
#                  A's was cut at 73 s, after the image's first step, before the text streams' 6-token step, whose
#                  variants the measure's first run then compiled: 3.6 s, before the image. Not with the short prompt
#                  steps at start, MOEBUS_WARM_PROMPT_STEPS=1: their ~15 s of compiles would push the image's step,
#                  whose compile would land inside the measured cold start, past the cut)
#   PHASE=measure  gap15.sh's reading of RUNS: "default" with the logs above, then "step0" (the same with
#                  MOEBUS_IMAGE_STEP_TOKENS=0: the image prompt in chunks of 510 + 246 tokens, not one of 756; the
#                  fifteenth session's question; call A: 2.73x / 4.13x against the default's 2.82x / 5.34x), then
#                  "prompt1" (MOEBUS_WARM_PROMPT_STEPS=1: its start line, its steps), each only where 34 s are left; RUNS="tag:VAR=v,..."
#                  any list; each at most RUN_CAP s (80), then each run's worker starts with their kernel counts, its
#                  steps over 300 ms with what they compiled and where they waited, its full collections,
#                  and last gap15_gaps.py's short summary (the ratios, the largest gaps with what was in them).
#   PHASE=measure BUDGET=106 bash tools/device/gap16.sh
source tools/device/setup.sh
set -o pipefail
BUDGET=${BUDGET:-106}
export V=${V:-/tmp/gap-a3b-8x128-vision}
LOGS=MOEBUS_LOG_STEPS=1,MOEBUS_LOG_GC_MS=2,MOEBUS_STEP_STACKS_S=0.5,MOEBUS_LOG_DECODE_MS=1
first_use() {  # log: its starts, slow steps and collections
  timeout 15 python3 tools/device/gap16_first_use.py $1 | cut -c1-300 | head -${2:-40}
}
if [ "$PHASE" = warm ]; then
  [ -f $V/.gap12-ready ] || { rm -rf $V; timeout $((BUDGET - 50)) python3 -m moebus.cli init-model $V --preset a3b \
    --layers 8 --vision siglip > $OUT/init.log 2>&1 && touch $V/.gap12-ready; }
  echo "model at ${SECONDS} s: $(du -sh $V 2>/dev/null | cut -f1) ($(tail -1 $OUT/init.log 2>/dev/null | cut -c1-120))"
  left=$((BUDGET - SECONDS - 10))
  if [ $left -gt 20 ]; then  # compiles into the disk cache (no figure: other branches run beside)
    env ${LOGS//,/ } SKIP_TESTS=1 TAG=warm BUDGETS=256 FIRST_CAP=$left BUDGET=$left bash tools/device/gap10.sh \
      > $OUT/warm_cycle.txt 2>&1
    grep -E "^rc=" $OUT/warm_cycle.txt
    L=$OUT/cycle_budget256_warm.log
    echo "ERROR lines: $(grep -c ERROR $L), tracebacks: $(grep -c Traceback $L)"; grep -m1 -A8 Traceback $L | cut -c1-200
    grep -hE "prompt steps of .* run in|decode graphs captured" $L | sed -E 's/^.*INFO //' | cut -c1-200
    first_use $L 24; gzip -f $L
  else echo "no warm cycle: ${left} s left"; fi
  exit 0
fi
RUNS=${RUNS:-default:$LOGS step0:$LOGS,MOEBUS_IMAGE_STEP_TOKENS=0 prompt1:$LOGS,MOEBUS_WARM_PROMPT_STEPS=1}
RUNS="$RUNS" RUN_CAP=${RUN_CAP:-80} BUDGET=$((BUDGET - 12)) bash tools/device/gap15.sh
echo "== gap16: the workers' starts, their steps over 300 ms, their full collections (at ${SECONDS} s)"
for run in $RUNS; do
  tag=${run%%:*}; L=$OUT/cycle_budget256_$tag.log.gz
  echo "--- $tag"; [ -f $L ] && first_use $L 30 || echo "no log"
done
echo "== gap16 summary"
for run in $RUNS; do
  tag=${run%%:*}; L=$OUT/cycle_budget256_$tag.log.gz
  [ -f $L ] || continue
  zcat $L | grep -E "gpu0 kernels: |prompt steps of .* run in" | sed -E 's/^.*INFO //' | cut -c1-200 | head -3
  first_use $L 400 | tail -1
  zcat $L | grep -oE "Step of [0-9.]+ MB decoded in [0-9.]+ ms" | awk '{n++; mb+=$3; ms+=$7; if ($7>mx) mx=$7}
    END {if (n) printf "steps decoded over 1 ms: %d, mean %.2f MB in %.2f ms, the longest %.1f ms\n", n, mb/n, ms/n, mx}'
  timeout 10 python3 tools/device/gap15_gaps.py $L --summary "$tag" | cut -c1-330
done
echo "== gap16 done at ${SECONDS} s"
