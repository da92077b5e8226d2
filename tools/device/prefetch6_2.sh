#!/usr/bin/env bash
# One H200 (~90 s; not run yet): which prefetch, if any, pays. prefetch6_1.sh measured 4 slots a layer
# over each token's top-8 predicted experts SLOWER than none on 16 x 32 at a 25% cache (-14% at batch 1,
# -9% at batch 8: 30% of the copies wasted, and a step already at ~45 GB/s of PCIe has little compute
# left to hide). This sweeps fewer slots and fewer predicted ranks (more precise, less waste: on cpu the
# top-2 predicted were right 0.96 of the time, the top-8 0.77, prefetch6_precision.py): off, then
# SLOTS:RANKS variants, each bench decode's figures at batch 1 and 8, after the bit-for-bit check of
# the first. Logs under $OUT.
source tools/device/setup.sh
set -o pipefail
M=/tmp/m16
timeout 60 python3 -m moebus.cli init-model $M --preset a3b --layers 16 --experts 32 > $OUT/init.log 2>&1
echo "== prefetch6_check.py (16 x 32, 25% cache), variants"; date
timeout 200 python3 tools/device/prefetch6_check.py $M 64 4:2,2:2,4:3,3:3,4:4,4:8 2>&1 | grep -v Warn \
  | tee $OUT/check.txt | tail -30
date
