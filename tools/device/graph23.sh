#!/usr/bin/env bash
# Twenty-third session: graph == eager bit for bit (tools/device/graph_check.py: batch 1 and 8, eager / graph /
# launched ahead / a 25% cache) with bf16 KV caches, so that the decode attention runs on tensor cores with
# qkv_rope_store as its prologue (rope_attention.py), int4 experts, FP8 attention (route_end after the ROUTE entry);
# then the same with bf16 experts and attention. A 4-layer a3b model (the 48-layer one's kernel shapes).
source tools/device/setup.sh
M=/tmp/m4; export NUMBA_CACHE_DIR=/tmp/graph23-nc
timeout 60 python3 -m moebus.cli init-model $M --preset a3b --layers 4 --experts 32 > /dev/null 2>&1; echo "init rc=$?"
for dtypes in "int4 fp8" "bf16 bf16"; do
  set -- $dtypes
  echo "== experts $1, attention $2, KV bf16"
  KV_DTYPE=bf16 EXPERTS_DTYPE=$1 ATTENTION_DTYPE=$2 timeout ${CHECK_S:-150} python3 tools/device/graph_check.py $M \
    2>&1 | grep -vi warn | tail -12
done
