#!/usr/bin/env bash
# One H200, issue 20 item 3's last target (sixth session, branch gap6; ~90 s on a bare machine):
# `bench vision-cycle --device cuda --gpu-memory-mib 8192` on the 8 x 128 A3B-shaped LLaVA (so400m)
# as merged5.sh runs it, but without row (a) (one broker start less: the rows were checked at
# merged5) and with two cold images: the first pays the processes' first-use costs (the vision
# worker's kernels compiled), the second is measured with text streams that decode until the image
# request has answered: each
# stream's own gaps in the steady state beside the broker's step interval, then by phase of the cold
# start (hand-back, start, encode, the image's prefill and decode) with the broker's steps in each;
# the workers' VRAM steps summed up, slow decode steps and the vision worker's start by part, with
# their times (tools/device/gap6_logs.py: to place each large gap). Logs under $OUT.
source tools/device/setup.sh
set -o pipefail
V=/tmp/a3b-8x128-vision
[ -d $V ] || timeout 90 python3 -m moebus.cli init-model $V --preset a3b --layers 8 --vision siglip > $OUT/init.log 2>&1
echo "== vision-cycle under 8 GiB (8 x 128 LLaVA, so400m)"; date
timeout 150 python3 -m moebus.cli bench vision-cycle --device cuda --model $V --gpu-memory-mib 8192 -v \
  --idle-s 1 --repeats 1 --text-streams 2 --skip-resident --cold-starts 2 --timeout-s 120 > $OUT/cycle.log 2>&1
echo "rc=$?"
grep -vE "^\{" $OUT/cycle.log | grep -E "^\(|^  |cold image|text streams|warm image|target|not checked" | cut -c1-230
echo "== the measured cold start in the workers' logs (ms after its first VRAM step)"
python3 tools/device/gap6_logs.py $OUT/cycle.log
date
