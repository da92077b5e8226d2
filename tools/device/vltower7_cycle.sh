#!/usr/bin/env bash
# One H200 (~120-150 s on a bare machine, never run yet): issue 18's owed figures, trimmed in the
# eighth session (was 8 layers, 3 repeats, ~200 s) — the cold image request's first token after
# the hand-back (target <= 1.0 s) and the four-row table of `bench vision-cycle` on the a3b preset of Qwen3-VL-30B-A3B, now 4 language layers
# x 128 experts (the fewest that take its 3 DeepStack features; ~4.8 GB of experts, half of 8 layers'
# init and load) with the full 27-block tower, random weights, under an 8 GiB VRAM budget, one
# 1024 px image, two cold starts (the second measured: the first pays the processes' first-use
# costs), 2 repeats, two text streams. Logs under $OUT.
source tools/device/setup.sh
set -o pipefail
Q=/tmp/a3b-qwen3vl-4
[ -d $Q ] || timeout 90 python3 -m moebus.cli init-model $Q --arch qwen3_vl_moe --preset a3b --layers 4 \
  > $OUT/init.log 2>&1 || { echo "init-model failed"; tail -5 $OUT/init.log; exit 1; }
echo "== vision-cycle under 8 GiB (Qwen3-VL a3b, 4 layers)"; date
timeout 150 python3 -m moebus.cli bench vision-cycle --device cuda --model $Q --gpu-memory-mib 8192 -v \
  --idle-s 1 --repeats 2 --image-px 1024 --text-streams 2 --cold-starts 2 --timeout-s 120 \
  > $OUT/cycle.log 2>&1
echo "rc=$?"
grep -vE "^\{" $OUT/cycle.log | grep -E "^\(|^  |cold image|text streams|warm image|target|not checked" | cut -c1-230
date
