#!/usr/bin/env bash
# One H200, issue 20's hand-back (~140 s on a bare machine): the VRAM arena's and launch-ahead GPU
# tests, the hand-back step's parts timed (tools/device/vmm_timing.py), then `bench vision-cycle --gpu-memory-mib 8192 -v`
# on the 8 x 128 LLaVA (so400m), as at c7ade26: rows, split, gaps; the workers' VRAM and slow-step lines.
source tools/device/setup.sh
set -o pipefail
V=/tmp/a3b-8x128-vision
[ -d $V ] || (timeout 90 python3 -m moebus.cli init-model $V --preset a3b --layers 8 --vision siglip > $OUT/init.log 2>&1) &
INIT=$!
echo "== GPU tests"; date
MOEBUS_TEST_GPU=1 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_vmm_arena.py tests/cuda/test_launch_ahead.py 2>&1 | tail -3
echo "== a hand-back step's parts"
timeout 60 python3 tools/device/vmm_timing.py 2>&1 | tee $OUT/vmm_timing.txt
wait $INIT
echo "== vision-cycle under 8 GiB (8 x 128 LLaVA, so400m)"; date
timeout 200 python3 -m moebus.cli bench vision-cycle --device cuda --model $V --gpu-memory-mib 8192 -v \
  --idle-s 3 --repeats 3 --text-streams 2 --text-tokens 64 --timeout-s 180 > $OUT/cycle.log 2>&1
grep -E "^\(|cold image|text streams|largest|warm image|target" $OUT/cycle.log
echo "== the workers' VRAM steps, slow decode steps, vision start"
grep -E "VRAM|decode step|vision worker ready|placed on|kernels:" $OUT/cycle.log | sed 's/^2026-[0-9-]* //' | cut -c1-200
date
