#!/usr/bin/env bash
# One H200 (~3 min): what a decode step of a batch size never seen before costs at 48 x 32 (graph
# capture and kernel compiles, plain and masked: the schema bench's timed runs captured graphs), and
# (the Qwen3-VL tower moved to the merged-tree call).
source tools/device/setup.sh
M=/tmp/m48; Q=/tmp/a3b-qwen3vl
timeout 120 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $OUT/init_m.log 2>&1
echo "== capture probe (fresh kernel cache)"; date
NUMBA_CACHE_DIR=/tmp/numba-probe timeout 200 python3 tools/device/capture_probe.py $M 8 2>&1 | grep -v "Warn\|warn(" | tee $OUT/capture.txt | tail -22
date
