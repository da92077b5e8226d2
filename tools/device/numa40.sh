#!/usr/bin/env bash
# One GPU (thirty-fifth session; issue 20): the machine's NUMA layout as the VM shows it, and mapped reads of
# 108 MiB windows walking a 6 GiB pinned buffer (as a decode step's misses fall over the host store) for 40 s:
# do standalone reads show the worker's clustered slow steps? (~1 min)
#   bash tools/device/numa40.sh 2>&1 | tail -20      (carry .whl)
source tools/device/setup.sh > /dev/null
nvidia-smi --query-gpu=name,pci.bus_id --format=csv,noheader
lscpu | grep -iE "numa|model name|socket"
for d in /sys/bus/pci/devices/*; do [ "$(cat $d/vendor 2>/dev/null)" = 0x10de ] && echo "$d numa_node $(cat $d/numa_node)"; done
nvidia-smi topo -m 2>&1 | head -4
python3 tools/device/jitter37.py --mib 108 --total-mib 6144 --mapped-s 40 2>&1 | grep -vi warn | cut -c1-1500
grep -E "^(MemTotal|MemFree|HugePages_Total|AnonHugePages)" /proc/meminfo
