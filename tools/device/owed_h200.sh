#!/usr/bin/env bash
# One H200 call for the two figures owed by issues 17 and 20 (2026-12-01, fourth session):
# (1) `bench decode --schema` batch 8 with one sequence under the nested schema vs none (issue 17,
#     target >= 0.9x), on a 24 x 64 A3B-shaped model; (2) `firstrun_h200.sh bench`: bench vision-cycle
#     --gpu-memory-mib 8192 on an 8 x 128 A3B-shaped LLaVA with SigLIP-so400m (issue 20: (b) == (d) >
#     (a) ~ (c), real MiB, the text streams' largest gap through the cold start <= 2x their median).
set -u
source tools/device/setup.sh
echo "== bench decode --schema"; date
python3 - > /tmp/nested_schema.json <<'PY'
import json
from tests.structured_schemas import SCHEMAS
print(json.dumps(SCHEMAS["nested"]))
PY
python3 -m moebus.cli init-model /tmp/m24 --preset a3b --layers 24 --experts 64 2>&1 | tail -1
timeout 200 python3 -m moebus.cli bench decode --model /tmp/m24 --device cuda --batch 8 --tokens 128 --repeats 3 --no-service \
  --schema /tmp/nested_schema.json 2>&1 | grep -v Warn | tee $OUT/bench_schema.txt | tail -12
rm -rf /tmp/m24
echo "== firstrun bench"; date
timeout 330 bash tools/device/firstrun_h200.sh bench 2>&1 | tail -45
date
