#!/usr/bin/env bash
# One H200 (twenty-fifth session). Issue 20's gap: what the slow decode steps right after the hand-back are made of.
# The twenty-fourth session's `off` runs (8 x 128 A3B LLaVA at 8 GiB): after the last hand-back step the decode steps
# go from ~4 to ~8.5 ms for ~250 ms (the largest gaps through hand-back, start and encode: 13.7 ms against a 5.8 ms
# median), then back to ~6 ms while the cache stays at 479 slots; the vision worker's context is made over the same
# window (~370 ms). The worker's step line now gives each step's misses and MiB over PCIe: gap25_steps.py bins them.
# One call:
#   1. route_end's WIDE path (its second form, never run on a GPU): ncu against route_tail, then its GPU tests
#      (ROUTE=0 skips);
#   2. gap17.sh's warm phase (the model, one cycle filling the kernel cache), then vis17.sh's measure with RUNS:
#      off (defaults), wide (10.5 GiB: every expert fits idle), m3 (MOEBUS_ADMISSION_MARGIN=3: fewer admissions
#      beside the misses);
#   3. per run gap25_steps.py's bins (bins.txt), gap15_gaps.py's summary (summaries.txt).
# Everything is written under /tmp/g25 and the few files worth keeping copied to $OUT (8 come back).
#   WARM_S=115 MEASURE_S=125 bash tools/device/gap25.sh
# Twenty-sixth session: CTX=1 runs ctx26.py (now ctx31.py) first (a context's limits); per run a line with the step pool's MiB
# allocated beyond a loan by the end and the cache's slots at each vision reserve. Twenty-seventh: and at ready, where
# the token embedding is, the stack limits set; the reserve of 1 GiB and more at each vision reserve (the vision
# worker's footprint, so the reserve, may change with the stack limit).
source tools/device/setup.sh
FINAL=$OUT; T=/tmp/g25; rm -rf $T; mkdir -p $T/r $T/v
LOGS=MOEBUS_LOG_STEPS=1,MOEBUS_LOG_GC_MS=2
if [ "${ROUTE:-1}" = 1 ]; then
  OUT=$T/r VARIANTS="route_tail 1024 256" TESTS="tests/cuda/test_route_end.py" TESTS_S=110 bash tools/device/route24.sh
  cp $T/r/tests.txt $FINAL/route_tests.txt 2>/dev/null
  echo "== route done at ${SECONDS} s"
fi
if [ -n "$CTX" ]; then  # twenty-sixth session: what a CUDA context holds and what its limits give back
  timeout 60 python3 tools/device/ctx31.py 2>&1 | tail -9  # (ctx26.py's successor, thirty-first session)
fi
export OUT=$T/v
PHASE=warm BUDGET=${WARM_S:-115} bash tools/device/gap17.sh | tail -6
echo "== warm done at ${SECONDS} s"
# call A: off wide:$LOGS,GPU_MIB=10752 m3:$LOGS,MOEBUS_ADMISSION_MARGIN=3 (the slow steps: the streams' working set
# moving on at fixed tokens, with the smaller cache, and ~25 admissions a step beside ~50 misses). Call B: the
# admissions within the link's room (MOEBUS_ADMISSION_PEAK, on) against peak0 (off), twice, and 16 MiB segments
# (the hand-back steps' unmap and release: ~65 us a 2 MiB segment)
export VIS_RUNS=${VIS_RUNS:-"off:$LOGS peak0:$LOGS,MOEBUS_ADMISSION_PEAK=0 seg16:$LOGS,MOEBUS_SEGMENT_MIB=16 off2:$LOGS peak02:$LOGS,MOEBUS_ADMISSION_PEAK=0"}
PHASE=measure BUDGET=${MEASURE_S:-125} bash tools/device/vis17.sh | tail -12
for run in $VIS_RUNS; do
  tag=${run%%:*}; L=$OUT/cycle_budget256_$tag.log.gz
  [ -f $L ] || continue
  cp $L $FINAL/
  { echo "=== $tag"; timeout 10 python3 tools/device/gap25_steps.py $L --bin-ms 50 --from-ms -150 --until-ms 1000; } >> $FINAL/bins.txt 2>&1
  { echo "=== $tag"; cat $OUT/summary_$tag.txt; } >> $FINAL/summaries.txt 2>&1
  # twenty-sixth session: the pool beyond the loans (0 expected with the pow2 loan) and the image's slots
  echo "$tag: $(zcat $L | grep -c 'allocated beyond a loan so far') step lines; last: $(zcat $L \
    | grep -oE '[0-9.]+ allocated beyond a loan so far' | tail -1); VRAM >= 1 GiB (MiB: slots): $(zcat $L \
    | grep -oE 'VRAM [0-9.]+: [0-9]+ expert slots' | awk '$2 + 0 >= 1024 {print $2 " " $3}' | tr '\n' ' '); ready: $(zcat $L \
    | grep -oE "'expert_slots': [0-9]+" | head -1 | awk '{print $2}') slots; $(zcat $L | grep -oE 'token embedding: .*' \
    | head -1); $(zcat $L | grep -oE 'CUDA stack limit [0-9]+ B' | sort | uniq -c | tr -s ' ' | tr '\n' ';')"
  # twenty-eighth session: at each vision worker's start, the hand-back's last reserve and its slots (a streamed
  # tower's reserve falls below 1 GiB), the worker's footprint, what the next hand-back frees
  # twenty-ninth session: the bench's own verdicts (until encoded and whole, against the median before / over the cycle)
  echo "$tag ratios (until encoded before/cycle, whole before/cycle): $(zcat $L | grep -E "^text streams' largest gap" \
    | grep -oE '[0-9.]+ \(target' | cut -d' ' -f1 | tr '\n' ' ')"
  echo "$tag starts: $(zcat $L | awk '/ VRAM [0-9.]+: [0-9]+ expert slots/ {for (i = 1; i < NF; i++) if ($i == "VRAM") \
    {r = $(i + 1); s = $(i + 2)}} /vision worker ready on gpu[0-9]+ \(pid/ {printf "reserve %s %s slots; ", r, s}'); \
$(zcat $L | grep -oE 'vision worker footprint: [0-9.]+ MiB' | sort | uniq -c | tr -s ' ' | tr '\n' ';') \
$(zcat $L | grep -oE 'the next hand-back there frees [0-9.]+ MiB' | sort | uniq -c | tr -s ' ' | tr '\n' ';')"
done
if [ -n "$DECODE" ]; then  # the steady decode at a 25% cache, the peak on and off (in process: no service)
  for peak in ${PEAKS:-2 0}; do
    MOEBUS_ADMISSION_PEAK=$peak timeout 60 python3 -m moebus.cli bench decode --model /tmp/gap-a3b-8x128-vision \
      --device cuda --cache-frac 0.25 --batch 1,8 --tokens 64 --repeats 2 --no-service 2>&1 | grep -E "^ +[0-9]+ +[0-9.]+ " \
      | awk -v p=$peak '{print "peak " p ": batch " $1 ", " $2 " tok/s, " $3 " ms a step, hit rate " $5 ", " $6 " GB/s"}'
  done
fi
echo "== bins (50 ms; decode steps: n, median / max ms, misses, MiB a step)"
grep -E "^===|^ *[0-9-]+-[0-9]+ " $FINAL/bins.txt | awk '/^===/ {print; next} {printf "%s %s %s %s %s | ", $1, $3, $4, $5, $6} END {print ""}' \
  | sed 's/| ===/\n===/g' | cut -c1-1500
echo "== gap25 done at ${SECONDS} s"
