#!/usr/bin/env bash
# One H200, branch miss10 (issue 15 item 2: a 25% cache against its PCIe bound), ~120 s (+ the start) on a fresh
# machine. GPU tests of the prefetch kernels (the placement-row remap for tiles is new), then
# miss10_check.py on a 16 x 32 A3B-shaped bf16 model at a 25% cache: graph + prefetch == graph without
# (batch 1 and 8, bit for bit), bench decode's figures off and per variant SLOTS:RANKS (the top-2 at
# 1 and 2 slots, 2 with 64 copy blocks a slot; 4:4, since bench decode's rows are copies of one prompt, so the top-2 name at
# most 2 experts a layer), batch 8 on GEMVs with the prefetch (as before this branch), CUPTI timelines, the copy kernel's mapped
# reads. 16 layers, not 48: the share of the bound is a per-layer matter (PCIe time and the compute
# beside it both scale with the layers; lm_head and sampling, once a step, are ~1-2% of it).
# VARIANTS / PROFILED / TOKENS override the lists. Logs under $OUT.
source tools/device/setup.sh
set -o pipefail
M=/tmp/m16; BUDGET=${BUDGET:-120}; T0=$(date +%s)
now() { echo $(( $(date +%s) - T0 )); }
[ -f $M/generation_config.json ] || timeout 60 python3 -m moebus.cli init-model $M --preset a3b --layers 16 \
  --experts 32 > $OUT/init.log 2>&1
echo "init16 rc=$? at $(now) s"
MOEBUS_TEST_GPU=1 timeout 40 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_prefetch.py 2>&1 \
  | tail -2 &
TESTS=$!
VARIANTS=${VARIANTS:-2:2,1:2,2:2:b64,4:4,2:2:gemv}
PROFILED=${PROFILED:-off,2:2}
echo "== miss10_check.py $M ${TOKENS:-32} $VARIANTS $PROFILED at $(now) s"
CHECK_BUDGET=$(( BUDGET - $(now) - 5 )) timeout $(( BUDGET - $(now) - 3 )) python3 tools/device/miss10_check.py $M \
  ${TOKENS:-32} $VARIANTS $PROFILED 2>&1 | grep -av "Warn\|warn(" | tee $OUT/check.txt | grep -av "^off \|^[0-9]:"
echo "check rc=$? at $(now) s"
wait $TESTS
