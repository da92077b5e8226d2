#!/usr/bin/env bash
# One H200 (~150-200 s on a bare machine), issue 18's owed figures, never measured on this model: the
# cold image request's first token after the hand-back (target <= 1.0 s) and the four-row table of
# `bench vision-cycle` on the a3b preset of Qwen3-VL-30B-A3B (8 language layers x 128 experts, the
# full 27-block tower; random weights), under an 8 GiB VRAM budget, one 1024 px image, two cold
# starts (the second measured, the processes' first-use costs paid by the first), two text streams.
# Logs under $OUT.
source tools/device/setup.sh
set -o pipefail
Q=/tmp/a3b-qwen3vl-8
[ -d $Q ] || timeout 120 python3 -m moebus.cli init-model $Q --arch qwen3_vl_moe --preset a3b --layers 8 \
  > $OUT/init.log 2>&1 || { echo "init-model failed"; tail -5 $OUT/init.log; exit 1; }
echo "== vision-cycle under 8 GiB (Qwen3-VL a3b, 8 layers)"; date
timeout 200 python3 -m moebus.cli bench vision-cycle --device cuda --model $Q --gpu-memory-mib 8192 -v \
  --idle-s 1 --repeats 3 --image-px 1024 --text-streams 2 --cold-starts 2 --timeout-s 150 \
  > $OUT/cycle.log 2>&1
echo "rc=$?"
grep -vE "^\{" $OUT/cycle.log | grep -E "^\(|^  |cold image|text streams|warm image|target|not checked" | cut -c1-230
date
