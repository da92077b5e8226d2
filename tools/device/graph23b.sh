#!/usr/bin/env bash
# Twenty-third session, call D: graph23.sh's failed row (bf16 experts and attention, bf16 KV, batch 8, a 25% cache:
# the same tokens, max |dlogprob| 5.0e-2) again, with fp32 KV (graph20's caches) and with bf16 KV but the rope
# attention off (MOEBUS_ROPE_ATTENTION=0): is it the new kernel?
source tools/device/setup.sh
M=/tmp/m4; export NUMBA_CACHE_DIR=/tmp/graph23-nc
timeout 60 python3 -m moebus.cli init-model $M --preset a3b --layers 4 --experts 32 > /dev/null 2>&1; echo "init rc=$?"
for run in "fp32 1" "bf16 0" "bf16 1"; do
  set -- $run
  echo "== bf16 experts and attention, KV $1, rope attention $2"
  BATCHES=8 KV_DTYPE=$1 MOEBUS_ROPE_ATTENTION=$2 timeout ${CHECK_S:-100} python3 tools/device/graph_check.py $M 2>&1 \
    | grep -vi warn | tail -5
done
