#!/usr/bin/env bash
# One H200 (~100 s), issue 15 item 2 (the next layer's experts prefetched on a side branch of the decode
# graph): the prefetch kernels' GPU tests, then prefetch6_check.py on a 16 x 32 A3B-shaped bf16 model
# at a 25% cache (graph == eager and prefetch on == off, bit for bit; bench decode's figures off and on).
# 16 layers, not 48, to fit the allowance: the per-layer figures and the share of the PCIe bound do not
# depend on the layer count. Logs under $OUT.
source tools/device/setup.sh
set -o pipefail
M=/tmp/m16
timeout 60 python3 -m moebus.cli init-model $M --preset a3b --layers 16 --experts 32 > $OUT/init.log 2>&1 &
echo "== GPU tests of the prefetch kernels"; date
MOEBUS_TEST_GPU=1 timeout 40 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_prefetch.py 2>&1 | tail -3
wait; tail -1 $OUT/init.log
echo "== prefetch6_check.py (16 x 32, 25% cache)"; date
timeout 120 python3 tools/device/prefetch6_check.py $M 64 4:8 2>&1 | grep -v Warn | tee $OUT/check.txt | tail -24
date
