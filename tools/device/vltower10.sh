#!/usr/bin/env bash
# One H200 (issue 18, branch vltower10; this task's allowance is 200 s of device time, start included).
# PART=1 (the first, short call): vltower9_encode.py (LEAN) with the ninth session's three opt-in passes
#   switched on (MOEBUS_TOWER_FUSED_ROPE=1, MOEBUS_TOWER_SPLIT_ATTENTION_OUT=1, MOEBUS_FLASH_HALF_KSTEP=1):
#   its variants toggle each back off, so their "max |diff| / max |default|" is each opt-in against its
#   unfused twin; the warm encode's median and the GPU time by kernel of that default.
# PART=2: vltower10_encode.py with the three opt-ins on (its docstring: the attention's layouts alone, the
#   in-process GPU tests, the tower and its variants, each while the budget lasts).
# BUDGET: seconds of wall for the whole script. Logs under $OUT; the figures on stdout.
source tools/device/setup.sh
set -o pipefail
T0=$(date +%s)
left() { echo $(( ${BUDGET:-150} - ($(date +%s) - T0) )); }
if [ "${PART:-1}" = 1 ]; then
  echo "== PART 1: the opt-ins on, each variant toggles one off (a3b tower, 1024 x 768)"; date
  MOEBUS_TOWER_FUSED_ROPE=1 MOEBUS_TOWER_SPLIT_ATTENTION_OUT=1 MOEBUS_FLASH_HALF_KSTEP=1 VLTOWER9_LEAN=1 \
    timeout $(left) python3 tools/device/vltower9_encode.py ${REPEATS:-10} 2>&1 | grep -av "Warn\|warn(" \
    | tee $OUT/part1.txt | cut -c1-300
  echo "part1 rc=$?"
else
  echo "== PART 2: vltower10_encode.py, the ninth session's opt-ins on"; date
  export MOEBUS_TOWER_FUSED_ROPE=1 MOEBUS_TOWER_SPLIT_ATTENTION_OUT=1 MOEBUS_FLASH_HALF_KSTEP=1
  BUDGET_S=$(( $(left) - 3 )) timeout $(left) python3 tools/device/vltower10_encode.py ${REPEATS:-10} 2>&1 | grep -av "Warn\|warn(" \
    | tee $OUT/part2.txt | cut -c1-300
  echo "part2 rc=$?"
fi
date
