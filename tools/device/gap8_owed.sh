#!/usr/bin/env bash
# One H200 (~150 s bare), what the eighth session (branch gap8) changed without measuring it: the
# cycle with the new defaults (admission margin 1, vision.handback_step_mib 64: no flag, no env) and
# row (a) this time (no --skip-resident: the four rows' check runs), then the same cycle with
# --handback-step-mib 256 (the old default) for the hand-back's length against its largest gap at
# ~7 ms steps. The 8 x 128 A3B-shaped LLaVA (so400m) as gap6/gap7/gap8 build it; --max-batch 4 as in
# gap8_cycle.sh. Logs under $OUT; a summary of both runs at the end.
source tools/device/setup.sh
set -o pipefail
V=/tmp/a3b-8x128-vision
[ -d $V ] || timeout 90 python3 -m moebus.cli init-model $V --preset a3b --layers 8 --vision siglip > $OUT/init.log 2>&1
echo "model built at ${SECONDS} s"
cycle() {  # name, timeout s, extra flags...
  local L=$OUT/cycle_$1.log T=$2
  shift 2
  echo "== vision-cycle under 8 GiB, $* (at ${SECONDS} s)"
  timeout $T python3 -m moebus.cli bench vision-cycle --device cuda --model $V --gpu-memory-mib 8192 -v --idle-s 1 \
    --repeats 1 --text-streams 2 --cold-starts 2 --max-batch 4 --timeout-s 90 "$@" > $L 2>&1
  echo "rc=$? (at ${SECONDS} s)"
  grep -vE "^\{" $L | grep -E "^\(|^  |cold image|text streams|warm image|target" | cut -c1-240
  timeout 20 python3 tools/device/gap6_logs.py $L | head -12
  echo "-- ERROR lines in the whole log: $(grep -c ERROR $L)"
}
cycle defaults 120
if [ $SECONDS -lt 120 ]; then cycle step256 $((175 - SECONDS)) --skip-resident --handback-step-mib 256; fi
echo "== summary (s: ${SECONDS})"
for L in $OUT/cycle_*.log; do
  echo "-- $(basename $L)"
  grep -E "^\((a|b|c|d)\)|^\(b\) == \(d\)|^cold image request 2|steady state before|^  (handback|start|encode|prefill) |largest gap through hand-back, start and encode / their median before" $L | cut -c1-200
done
