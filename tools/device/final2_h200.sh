#!/usr/bin/env bash
# One H200, after final_h200.sh: the GPU tests again (that run stopped at a crash in a test since
# fixed), and issue 20's healthy cuda start (`grep -c ERROR`, the README's image example on cuda).
source tools/device/setup.sh
set -o pipefail
echo "== GPU tests"; date
MOEBUS_TEST_GPU=1 timeout 150 python3 -m pytest -q -rf -p no:cacheprovider tests/cuda 2>&1 \
  | tee $OUT/gpu_tests.txt | grep -E "passed|failed|FAILED|Error|Fatal" | tail -15
echo "== a cuda start (issue 20)"; date
OUT=$OUT timeout 170 bash tools/device/firstrun_h200.sh start 2>&1 | tail -30
date
