#!/usr/bin/env bash
# One H200 (~3 min): what a decode step of a batch size never seen before costs at 48 x 32 (graph
# capture and kernel compiles, plain and masked: the schema bench's timed runs captured graphs), and
# the Qwen3-VL a3b tower's encode (owed5.sh built a 2-layer model its loader refused).
source tools/device/setup.sh
M=/tmp/m48; Q=/tmp/a3b-qwen3vl
timeout 90 python3 -m moebus.cli init-model $Q --arch qwen3_vl_moe --preset a3b --layers 3 --experts 16 > $OUT/init_q.log 2>&1 &
timeout 120 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $OUT/init_m.log 2>&1
echo "== capture probe (fresh kernel cache)"; date
NUMBA_CACHE_DIR=/tmp/numba-probe timeout 200 python3 tools/device/capture_probe.py $M 8 2>&1 | grep -v "Warn\|warn(" | tee $OUT/capture.txt | tail -22
wait
echo "== Qwen3-VL tower (a3b, 1024 x 768)"; date
timeout 60 python3 tools/device/vltower_encode.py $Q 7 2>&1 | grep -v "Warn\|warn(" | tee $OUT/tower.txt | head -24
date
