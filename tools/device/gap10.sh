#!/usr/bin/env bash
# One H200, issue 20 item 3 (tenth session, branch gap10): the text streams' gaps through a cold LLaVA
# image with the spanning chunk's expert groups on tensor cores (moe_prefill.HostTiles) and its
# kernels warmed at the worker's start (spanning_chunk.warm). gap9_cycle.sh's cycle: the 8 x 128
# A3B-shaped LLaVA (so400m) under --gpu-memory-mib 8192, 2 text streams, --max-batch 4, cold start 2
# of 2, --skip-resident (rows (b)-(d) only), at each max_prefill_copy_mib_beside_decode of BUDGETS in
# turn while BUDGET allows (the first call, at 13:23 UTC: "256 128 64", only 256 fitted; the call owed,
# with the loan held across the chunk's steps: BUDGETS="128 256"). Beside the model's build: the GPU
# tests of the spanning chunk and HostTiles.
# Per run: the bench's rows and gap lines, the workers' phase lines (tools/device/gap6_logs.py), the
# spanning chunks (steps, experts copied in, step times), the warm-up line, the ERROR count.
#   BUDGET=122 bash tools/device/gap10.sh                   (as run: 109 s on a bare H200)
#   BUDGET=150 BUDGETS="128 256" bash tools/device/gap10.sh  (owed; BUDGET=115 BUDGETS=128: 128 alone)
# (eleventh session, tools/device/gap11.sh: SKIP_TESTS=1 leaves the GPU tests out, TAG=x names the logs cycle_*_x.log,
# FIRST_CAP the first cycle's timeout, 88 s unless set; thirtieth: CYCLE_ARGS more of the bench's arguments, one word
# each, e.g. CYCLE_ARGS=--control-tokens=0 in a gap25.sh run's variables)
source tools/device/setup.sh
set -o pipefail
BUDGET=${BUDGET:-122}
BUDGETS=${BUDGETS:-256 128 64}
V=${V:-/tmp/a3b-8x128-vision}  # (gap12.sh: its own)
[ -n "$SKIP_TESTS" ] || ( MOEBUS_TEST_GPU=1 timeout 70 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_spanning_chunk.py \
    tests/cuda/test_host_tiles.py > $OUT/gpu_tests.log 2>&1; echo "GPU tests rc=$?" >> $OUT/gpu_tests.log ) &
[ -d $V ] || timeout 90 python3 -m moebus.cli init-model $V --preset a3b --layers 8 --vision siglip > $OUT/init.log 2>&1
wait
[ -n "$SKIP_TESTS" ] || tail -4 $OUT/gpu_tests.log
echo "model built at ${SECONDS} s"
cycle() {  # name, copy budget MiB, timeout s
  local L=$OUT/cycle_$1${TAG:+_$TAG}.log B=$2 T=$3
  echo "== vision-cycle under 8 GiB, copy budget ${B} MiB a step beside decode (at ${SECONDS} s, timeout ${T} s)"
  MOEBUS_MAX_PREFILL_COPY_MIB_BESIDE_DECODE=$B timeout $T python3 -m moebus.cli bench vision-cycle --device cuda \
    --model $V --gpu-memory-mib ${GPU_MIB:-8192} -v --idle-s 1 --repeats 1 --text-streams 2 --cold-starts 2 --max-batch 4 \
    --timeout-s 90 --skip-resident $CYCLE_ARGS > $L 2>&1
  echo "rc=$? (at ${SECONDS} s)"
  grep -vE "^\{" $L | grep -E "^\(|^  |cold image|text streams|warm image|target|largest gap|stream [01]:" | cut -c1-220
  timeout 20 python3 tools/device/gap6_logs.py $L | head -24
  echo "-- spanning chunks: $(grep -c 'prompt chunk of .* done in' $L) done, $(grep -c 'prompt chunk of .* dropped' $L) dropped"
  grep -E "prompt chunk of|spanning chunk's kernels warmed" $L | sed -E 's/^.*(a prompt chunk|gpu0: the spanning)/\1/' \
    | cut -c1-230 | head -8
  echo "-- slow decode steps logged: $(grep -c 'decode step .* took' $L)"
  echo "-- ERROR lines in the whole log: $(grep -c ERROR $L)"
  grep ERROR $L | cut -c1-200 | sort | uniq -c | head -3
}
left() { echo $((BUDGET - SECONDS)); }
first=1
for B in $BUDGETS; do  # the first on a fresh kernel cache (~70 s), the next ~25-30 s each
  if [ $first = 1 ]; then cycle budget$B $B $(( $(left) < ${FIRST_CAP:-88} ? $(left) : ${FIRST_CAP:-88} )); first=0
  elif [ $(left) -gt 22 ]; then cycle budget$B $B $(( $(left) - 2 ))
  else echo "budget $B not run: ${SECONDS} s spent"; fi
done
echo "== done at ${SECONDS} s"
