#!/usr/bin/env bash
# One H200, the first call of the next session (~6 min): the fourth session's merged tree (decode
# kernels, look-ahead and launch-ahead, experts planned on the device, towers as graphs, the bf16 KV
# cache and the new decode attention) was tested on the GPU only branch by branch. Here: every GPU
# test of tests/cuda and tests/vision (no -x: the whole list of failures), eager == graph bit for bit
# (batch 1 and 8, all resident and a 25% cache), held-out fidelity per KV dtype. Logs under $OUT.
source tools/device/setup.sh
set -o pipefail
echo "== GPU tests"; date
MOEBUS_TEST_GPU=1 timeout 300 python3 -m pytest -q -rfE -p no:cacheprovider tests/cuda tests/vision 2>&1 \
  | tee $OUT/gpu_tests.txt | grep -E "passed|failed|FAILED|ERROR|xfail|XPASS" | tail -25
echo "== graph == eager"; date
timeout 30 python3 -m moebus.cli init-model /tmp/m4 --preset a3b --layers 4 --experts 32 > /dev/null 2>&1
timeout 90 python3 tools/device/graph_check.py /tmp/m4 2>&1 | grep -v Warn | tee $OUT/graph_check.txt | tail -8
echo "== fidelity per KV dtype (held-out models)"; date
timeout 120 python3 tools/device/tc_fidelity.py /tmp/fid split/split,off/split,split/split/bf16,off/split/bf16 2>&1 | grep -v Warn | tee $OUT/fidelity.txt | tail -12
date
