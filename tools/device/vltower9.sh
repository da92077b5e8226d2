#!/usr/bin/env bash
# One H200, ~160 s of wall (issue 18, branch vltower9; the allowance is 240 s with the machine's start):
# 1. init-model of the cycle's checkpoint (CPU and disk) in the background while
# 2. vltower9_encode.py: the new kernels' GPU tests (in process), the a3b tower's warm encode, its
#    phases, the fused passes on/off, the host copies on 8 threads, the GPU time by kernel;
# 3. the owed cold-image cycle (vltower7_cycle.sh's run: the first token after the hand-back and
#    `bench vision-cycle`'s four rows, a3b preset, 4 language layers), with what time is left.
# LEAN=1: vltower9_encode.py without the residual test and the second profile. Logs under $OUT;
# the figures on stdout.
source tools/device/setup.sh
set -o pipefail
T0=$(date +%s)
Q=/tmp/a3b-qwen3vl-4
( timeout 90 python3 -m moebus.cli init-model $Q --arch qwen3_vl_moe --preset a3b --layers 4 > $OUT/init.log 2>&1;
  echo "init-model rc=$?" >> $OUT/init.log ) &
INIT=$!
echo "== Qwen3-VL tower (a3b shapes, 1024 x 768); init-model runs beside it (CPU, disk)"; date
VLTOWER9_LEAN=${LEAN:-0} timeout 75 python3 tools/device/vltower9_encode.py 10 2>&1 | grep -av "Warn\|warn(" | tee $OUT/tower.txt | cut -c1-250
echo "tower rc=$?"
wait $INIT
tail -2 $OUT/init.log
LEFT=$(( ${BUDGET:-158} - ($(date +%s) - T0) ))  # BUDGET: seconds of wall for the whole script
echo "== vision-cycle under 8 GiB (Qwen3-VL a3b, 4 layers), ${LEFT} s left"; date
if [ -f $Q/config.json ] && [ $LEFT -gt 30 ]; then
  timeout $LEFT python3 -m moebus.cli bench vision-cycle --device cuda --model $Q --gpu-memory-mib 8192 -v \
    --idle-s 1 --repeats 2 --image-px 1024 --text-streams 2 --cold-starts 2 --timeout-s 120 \
    > $OUT/cycle.log 2>&1
  echo "cycle rc=$?"
  grep -vE "^\{" $OUT/cycle.log | grep -E "^\(|^  |cold image|text streams|warm image|target|not checked" | cut -c1-230
  tail -c 1500 $OUT/cycle.log | grep -v "^\{" | tail -8
else
  echo "cycle skipped (no checkpoint or too little time)"
fi
date
