#!/usr/bin/env bash
# One H200 (~150-190 s bare), issue 20 item 3 (ninth session, branch gap9): the text streams' gaps
# through a cold image with the prompt chunk that spans steps (workers/spanning_chunk.py) on and off.
# The 8 x 128 A3B-shaped LLaVA (so400m) as gap6/gap7/gap8 build it, under --gpu-memory-mib 8192,
# --max-batch 4 as in gap8_cycle.sh / gap8_owed.sh:
# - budget on (max_prefill_copy_mib_beside_decode's default, 128 MiB a step): the four rows (a)-(d)
#   and the gaps by phase; the image's prefill chunks should now take ~40-55 chunk steps each (with
#   the look-ahead's decode-only steps between them), every one within ~2x the steady decode step
#   (gap8: 2 steps of 110-215 ms, 25-34x);
# - budget off (MOEBUS_MAX_PREFILL_COPY_MIB_BESIDE_DECODE=0: the chunk runs whole, as at gap8) with
#   --skip-resident, for the baseline in the same call, if the call is under 125 s by then;
# - budget 256 MiB with --skip-resident if it is under 150 s by then (fewer, longer steps a chunk:
#   whether the default could be larger and keep the largest gap <= 2x).
# Beside the model's build: MOEBUS_TEST_GPU=1 pytest tests/cuda/test_spanning_chunk.py (the chunk's
# state in device buffers across steps, its token against the chunk run whole; micro model).
# Per run: the bench's rows and target lines, the phases (tools/device/gap6_logs.py), the worker's
# spanning chunks (steps, experts copied in) and the ERROR count. Logs under $OUT.
source tools/device/setup.sh
set -o pipefail
V=/tmp/a3b-8x128-vision
( MOEBUS_TEST_GPU=1 timeout 80 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_spanning_chunk.py \
    > $OUT/spanning_test.log 2>&1; echo "spanning chunk GPU test rc=$?" >> $OUT/spanning_test.log ) &
[ -d $V ] || timeout 90 python3 -m moebus.cli init-model $V --preset a3b --layers 8 --vision siglip > $OUT/init.log 2>&1
wait
tail -3 $OUT/spanning_test.log
echo "model built at ${SECONDS} s"
cycle() {  # name, budget MiB, timeout s, extra flags...
  local L=$OUT/cycle_$1.log B=$2 T=$3
  shift 3
  echo "== vision-cycle under 8 GiB, copy budget ${B} MiB a step beside decode, $* (at ${SECONDS} s)"
  MOEBUS_MAX_PREFILL_COPY_MIB_BESIDE_DECODE=$B timeout $T python3 -m moebus.cli bench vision-cycle --device cuda \
    --model $V --gpu-memory-mib 8192 -v --idle-s 1 --repeats 1 --text-streams 2 --cold-starts 2 --max-batch 4 \
    --timeout-s 90 "$@" > $L 2>&1
  echo "rc=$? (at ${SECONDS} s)"
  grep -vE "^\{" $L | grep -E "^\(|^  |cold image|text streams|warm image|target" | cut -c1-240
  timeout 20 python3 tools/device/gap6_logs.py $L | head -30
  echo "-- spanning chunks: $(grep -c 'prompt chunk of .* done in' $L) done, $(grep -c 'prompt chunk of .* dropped' $L) dropped"
  grep -E "prompt chunk of" $L | sed -E 's/^.*(a prompt chunk)/\1/' | cut -c1-160 | head -8
  echo "-- slow decode steps logged: $(grep -c 'decode step .* took' $L)"
  grep -E "decode step .* took" $L | sed -E 's/^.*(decode step)/\1/' | cut -c1-120 | head -6
  echo "-- ERROR lines in the whole log: $(grep -c ERROR $L)"
  grep ERROR $L | cut -c1-200 | sort | uniq -c | head -5
}
cycle budget128 128 125
if [ $SECONDS -lt 125 ]; then
  cycle budget0 0 $((192 - SECONDS)) --skip-resident
else
  echo "budget 0 not run: ${SECONDS} s spent"
fi
if [ $SECONDS -lt 150 ]; then  # a larger budget: fewer steps a chunk, each longer
  cycle budget256 256 $((192 - SECONDS)) --skip-resident
else
  echo "budget 256 not run: ${SECONDS} s spent"
fi
echo "== summary (s: ${SECONDS})"
for L in $OUT/cycle_*.log; do
  echo "-- $(basename $L)"
  grep -E "^\((a|b|c|d)\)|^\(b\) == \(d\)|^cold image request 2|steady state before|^  (handback|start|encode|prefill|decode) |largest gap|stream [01]:" $L \
    | cut -c1-200
done
