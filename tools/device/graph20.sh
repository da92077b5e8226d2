#!/usr/bin/env bash
# Twentieth session, call E: graph == eager bit for bit (tools/device/graph_check.py: batch 1 and 8, eager / graph /
# launched ahead / a 25% cache) with the new decode paths on: int4 experts, FP8 attention (the o projection starting
# the routing, linear_quant_mma.ROUTE), the FP8 lm_head; a 4-layer a3b model (the 48-layer one's kernel shapes).
source tools/device/setup.sh
M=/tmp/m4; export NUMBA_CACHE_DIR=/tmp/graph20-nc
timeout 60 python3 -m moebus.cli init-model $M --preset a3b --layers 4 --experts 32 > /dev/null 2>&1; echo "init rc=$?"
EXPERTS_DTYPE=int4 ATTENTION_DTYPE=fp8 LM_HEAD_DTYPE=fp8 timeout ${CHECK_S:-200} python3 tools/device/graph_check.py $M \
  2>&1 | grep -vi warn | tail -12
