#!/usr/bin/env bash
# Branch miss12 (issue 15: a 25% cache at >= 0.90 / 0.85 of the PCIe bound at batch 1 / 8, 48 x 32 A3B bf16),
# run by the lead's tools/device/lead12_call.sh. PHASE=warm: a 4 x 32 model of its own (/tmp/miss-m4) and
# a short miss12_check.py on it, so every kernel the measure phase runs is compiled (nothing timed).
# PHASE=measure: the host's NUMA / PCIe / huge-page facts, then miss12_check.py on $M48 (the lead's 48 x 32
# model): the raw link from the store's buffers, VARIANTS (bench decode's figures), PROFILED (CUPTI
# timelines: where the link idles in a step). VARIANTS / PROFILED / TOKENS / CHECK override.
source tools/device/setup.sh
set -o pipefail
T0=$(date +%s); BUDGET=${BUDGET:-110}
now() { echo $(( $(date +%s) - T0 )); }
cd tools/device
if [ "$PHASE" = warm ]; then
  M=/tmp/miss-m4
  [ -f $M/generation_config.json ] || timeout 40 python3 -m moebus.cli init-model $M --preset a3b --layers 4 \
    --experts 32 > $OUT/init4.log 2>&1
  echo "init4 rc=$? at $(now) s"
  CHECK=1 CHECKED=2 TIMELINES_AFTER=1 CHECK_BUDGET=$(( BUDGET - $(now) - 8 )) timeout $(( BUDGET - $(now) - 4 )) python3 miss12_check.py $M 4 \
    ${VARIANTS:-2:2:after,4:4:after,2:2,off} 2:2:after 2>&1 | grep -av "Warn\|warn(" | tail -30
  echo "warm check rc=$? at $(now) s"
  exit 0
fi
echo "== host at $(now) s"
lscpu | grep -i "numa\|model name" ; grep -h MemTotal /sys/devices/system/node/node*/meminfo
numactl -H 2>/dev/null | head -12
BUS=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | head -1 | tr 'A-F' 'a-f' | sed 's/^0000//')
echo "gpu $BUS numa_node $(cat /sys/bus/pci/devices/0000${BUS#0000}/numa_node 2>/dev/null || cat /sys/bus/pci/devices/${BUS}/numa_node 2>/dev/null)"
nvidia-smi --query-gpu=pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current --format=csv
nvidia-smi topo -m 2>/dev/null | head -4
echo "thp $(cat /sys/kernel/mm/transparent_hugepage/enabled) defrag $(cat /sys/kernel/mm/transparent_hugepage/defrag)"
echo "hugepages $(cat /proc/sys/vm/nr_hugepages); cmdline: $(grep -o 'iommu[^ ]*\|intel_iommu[^ ]*\|amd_iommu[^ ]*' /proc/cmdline | tr '\n' ' ')"
ls /sys/class/iommu 2>/dev/null | head -3; free -g | head -2
echo "== miss12_check.py $M48 at $(now) s"
CHECK=${CHECK:-1} TIMELINE_BATCHES=${TIMELINE_BATCHES:-1} TIMELINES_AFTER=${TIMELINES_AFTER:-2} CHECK_BUDGET=$(( BUDGET - $(now) - 4 )) \
  timeout $(( BUDGET - $(now) - 2 )) python3 miss12_check.py $M48 ${TOKENS:-32} \
  ${VARIANTS:-2:2:after,2:2,4:4:after,2:4:after,off} ${PROFILED:-2:2:after} 2>&1 | grep -av "Warn\|warn(" | tee $OUT/check.txt
echo "check rc=$? at $(now) s"
