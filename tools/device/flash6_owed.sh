#!/usr/bin/env bash
# One H200 (~120 s): what flash6_check.sh's call left unmeasured, for a later call (the lead's merged
# tree): the towers end to end with the fused attention (tower_encode.py: so400m from a LLaVA
# checkpoint and the Qwen3-VL-30B-A3B tower at 1024 x 768, graph and eager), and held-out fidelity at
# bf16 KV, fused (default) and materialised (MOEBUS_ATTENTION_FLASH=0), against float32 transformers.
source tools/device/setup.sh
set -o pipefail
V=/tmp/vis
timeout 60 python3 -m moebus.cli init-model $V --preset a3b --layers 1 --experts 8 --vision siglip > $OUT/init_v.log 2>&1
echo "== towers (graph and eager, warm, median of 10)"; date
timeout 60 python3 tools/device/tower_encode.py $V 2>&1 | grep -a -v "Warn\|warn(" | tee $OUT/towers.txt | tail -3
echo "== fidelity at bf16 KV: fused, then materialised"; date
timeout 60 python3 tools/device/tc_fidelity.py /tmp/fid split/split/bf16 2>&1 | grep -a -v "Warn\|Loading" \
  | tee $OUT/fidelity.txt | tail -9
MOEBUS_ATTENTION_FLASH=0 timeout 45 python3 tools/device/tc_fidelity.py /tmp/fid split/split/bf16 2>&1 \
  | grep -a -v "Warn\|Loading" | tee $OUT/fidelity_materialised.txt | tail -2
date
