#!/usr/bin/env bash
# Branch miss13 (issue 15: a 25% cache at >= 0.90 / 0.85 of the PCIe bound at batch 1 / 8, 48 x 32 A3B bf16),
# run by the lead's tools/device/lead13_call.sh. Reuses miss12_check.py (one load, the variants, CUPTI
# timelines). PHASE=warm: miss12.sh's 4 x 32 model /tmp/miss-m4 (~0.4 GB) and a short miss12_check.py on it
# over the same variants, so every kernel the measure phase runs is compiled (nothing timed).
# PHASE=measure: miss12_check.py on $M48 (the lead's model): the raw link (1, 2, 4 experts a copy kernel),
# CHECK (the first CHECKED flagged variants == no prefetch, bit for bit at batch 1 and 8), VARIANTS (bench
# decode's figures; SLOTS:RANKS[:after][:logits][:aN][:bNuM] or off), PROFILED (timelines, V@B: batch B only).
# VARIANTS / PROFILED / TOKENS / CHECK / CHECK_VARIANTS override; ``default`` is the tree's own prefetch.
source tools/device/setup.sh
set -o pipefail
T0=$(date +%s); BUDGET=${BUDGET:-110}
now() { echo $(( $(date +%s) - T0 )); }
V=${VARIANTS:-2:2,1:8:after,2:8:after,1:8:after:b4u16,1:4:after,2:8,1:8,3:8:after,off,2:2,1:8:after,2:2:a0}
P=${PROFILED:-2:2@8,1:8:after@8,2:8:after@8,1:8:after@1}
cd tools/device
if [ "$PHASE" = warm ]; then
  M=/tmp/miss-m4
  [ -f $M/generation_config.json ] || timeout 40 python3 -m moebus.cli init-model $M --preset a3b --layers 4 \
    --experts 32 > $OUT/init4.log 2>&1
  echo "init4 rc=$? at $(now) s"
  CHECK=1 CHECK_VARIANTS=1:8:after:b4u16,2:8:after TIMELINES_AFTER=1 CHECK_BUDGET=$(( BUDGET - $(now) - 8 )) \
    timeout $(( BUDGET - $(now) - 4 )) python3 miss12_check.py $M 8 2:2,1:8:after:b4u16,2:8:after 1:8:after@8 2>&1 \
    | grep -av "Warn\|warn(" | tail -16
  echo "warm check rc=$? at $(now) s"
  exit 0
fi
echo "== miss12_check.py $M48 at $(now) s: $V / $P"
CHECK=${CHECK:-1} CHECK_VARIANTS=${CHECK_VARIANTS-1:8:after,2:8:after} TIMELINES_AFTER=${TIMELINES_AFTER:-3} CHECK_BUDGET=$(( BUDGET - $(now) - 4 )) \
  timeout $(( BUDGET - $(now) - 2 )) python3 miss12_check.py $M48 ${TOKENS:-32} $V $P 2>&1 \
  | grep -av "Warn\|warn(" | tee $OUT/check.txt
echo "check rc=$? at $(now) s"
