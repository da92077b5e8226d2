#!/usr/bin/env bash
# One H200 call, the follow-up of owed_h200.sh: (1) `bench decode --schema` with every run's step
# count and step times (why the plain baseline ran 2.4x slower than the constrained run); (2) `bench
# vision-cycle --gpu-memory-mib 8192 -v` on the 8 x 128 LLaVA: the text gaps charged to each
# cold-start phase, and the workers' own VRAM-resize times from their log.
set -u
source tools/device/setup.sh
echo "== bench decode --schema"; date
python3 - > /tmp/nested_schema.json <<'PY'
import json
from tests.structured_schemas import SCHEMAS
print(json.dumps(SCHEMAS["nested"]))
PY
python3 -m moebus.cli init-model /tmp/m24 --preset a3b --layers 24 --experts 64 > /dev/null 2>&1
timeout 200 python3 -m moebus.cli bench decode --model /tmp/m24 --device cuda --batch 8 --tokens 128 --repeats 2 \
  --no-service --schema /tmp/nested_schema.json 2>&1 | grep -v Warn | tee $OUT/bench_schema.txt | tail -9
rm -rf /tmp/m24
echo "== vision-cycle under 8 GiB"; date
M=/tmp/a3b-8x128-vision
python3 -m moebus.cli init-model $M --preset a3b --layers 8 --vision siglip > /dev/null 2>&1 || exit 1
timeout 300 python3 -m moebus.cli bench vision-cycle --device cuda --model $M --gpu-memory-mib 8192 -v \
  --idle-s 3 --repeats 3 --text-streams 2 --text-tokens 64 --timeout-s 280 > $OUT/cycle.log 2>&1
echo "rc=$?"
grep -E "VRAM|hand-back|handback" $OUT/cycle.log | grep -v "^{" | tail -30
grep -E "^\(|cold image|text streams|largest|warm image|target" $OUT/cycle.log
date
