#!/usr/bin/env bash
# One H200, issue 20 item 3's last target (sixth session, branch gap6; ~90 s on a bare machine):
# `bench vision-cycle --device cuda --gpu-memory-mib 8192` on the 8 x 128 A3B-shaped LLaVA (so400m)
# as merged5.sh runs it, with text streams that decode until the image request has answered: each
# stream's own gaps in the steady state beside the broker's step interval, then by phase of the cold
# start (hand-back, start, encode, the image's prefill and decode) with the broker's steps in each;
# the workers' VRAM steps summed up, slow decode steps and the vision worker's start by part, with
# their times (to place each large gap). Logs under $OUT.
source tools/device/setup.sh
set -o pipefail
V=/tmp/a3b-8x128-vision
[ -d $V ] || timeout 90 python3 -m moebus.cli init-model $V --preset a3b --layers 8 --vision siglip > $OUT/init.log 2>&1
echo "== vision-cycle under 8 GiB (8 x 128 LLaVA, so400m)"; date
timeout 150 python3 -m moebus.cli bench vision-cycle --device cuda --model $V --gpu-memory-mib 8192 -v \
  --idle-s 1 --repeats 2 --text-streams 2 --timeout-s 120 > $OUT/cycle.log 2>&1
echo "rc=$?"
grep -vE "^\{" $OUT/cycle.log | grep -E "^\(|^  |cold image|text streams|warm image|target|not checked" | cut -c1-230
echo "== the workers' VRAM steps (hand-back: n, min / median / max ms; experts moved down)"
grep -E "gpu[0-9] VRAM [0-9]" $OUT/cycle.log | sed -E 's/.*VRAM [^:]*: [0-9]+ expert slots, ([0-9.]+) ms.* ([0-9]+) experts moved.*/\1 \2/' \
  | sort -n | awk '{a[NR]=$1; m+=$2} END {if (NR) print NR, a[1], a[int((NR+1)/2)], a[NR], "moved", m}'
grep -E "gpu[0-9] VRAM None" $OUT/cycle.log | sed 's/^2026-[0-9-]* //' | cut -c1-160 | head -3
echo "== slow decode steps, the vision worker's start by part (lazy run: the last ones)"
grep -E "decode step|vision worker start on|vision worker ready|idle for" $OUT/cycle.log | sed 's/^2026-[0-9-]* //' \
  | cut -c1-170 | tail -24
date
