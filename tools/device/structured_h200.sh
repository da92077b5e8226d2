#!/usr/bin/env bash
# One H200: structured outputs on the device. The masked sampler's kernel tests on the GPU, masks in
# captured decode graphs (tools/device/mask_graph_check.py), and `moebus bench decode --schema FILE`:
# batch 8 through the service with one sequence under a nested JSON schema vs none (target: the
# constrained run's 7 plain streams at >= 0.9x the plain run's tok/s), on an A3B-shaped model.
# Carry .whl with llguidance in it: ../shared/device/wheels.sh llguidance waitress requests
source tools/device/setup.sh
set -o pipefail
echo "== masked sampler kernel tests on the GPU"; date
MOEBUS_TEST_GPU=1 timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/cuda/test_sampling_mask.py \
  tests/cuda/test_sampling.py 2>&1 | tail -5 | tee $OUT/mask_kernel_tests.txt
echo "== masks in captured graphs"; date
python3 -m moebus.cli init-model /tmp/m4 --preset a3b --layers 4 --experts 32 2>&1 | tail -1
timeout 120 python3 tools/device/mask_graph_check.py /tmp/m4 2>&1 | grep -v Warn | tee $OUT/mask_graph_check.txt | tail -6
echo "== bench decode --schema (batch 8, one constrained)"; date
python3 - > /tmp/nested_schema.json <<'PY'
import json
from tests.structured_schemas import SCHEMAS
print(json.dumps(SCHEMAS["nested"]))
PY
rm -rf /tmp/m4; python3 -m moebus.cli init-model /tmp/m24 --preset a3b --layers 24 --experts 64 2>&1 | tail -1
timeout 400 python3 -m moebus.cli bench decode --model /tmp/m24 --device cuda --batch 8 --tokens 128 --repeats 3 \
  --no-service --schema /tmp/nested_schema.json 2>&1 | grep -v Warn | tee $OUT/bench_schema.txt | tail -8
date
