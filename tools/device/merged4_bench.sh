#!/usr/bin/env bash
# One H200, the second call of the next session (~9 min): the issue-15/17/20 figures on the merged
# tree, peers beside them. 48 x 32 A3B-shaped bf16 model: decode batch 1 and 8 in-process and
# through the service (look-ahead on), a 25% cache; then `bench decode --schema` (issue 17, batch 8,
# one constrained row) and `bench vision-cycle --gpu-memory-mib 8192` (issue 20: gaps by phase).
source tools/device/setup.sh
set -o pipefail
echo "== 48 x 32: decode in-process and through the service"; date
M=/tmp/m48
timeout 90 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > /dev/null 2>&1
timeout 150 python3 -m moebus.cli bench decode --model $M --device cuda --batch 1,8 --tokens 64 --repeats 2 \
  2>&1 | grep -v Warn | tee $OUT/decode48.txt | tail -16
timeout 80 python3 -m moebus.cli bench decode --model $M --device cuda --batch 1,8 --tokens 64 --repeats 2 \
  --no-service --cache-frac 0.25 2>&1 | grep -v Warn | tee $OUT/decode48_25.txt | tail -4
echo "== bench decode --schema (48 x 32, batch 8)"; date
python3 -c "import json; from tests.structured_schemas import SCHEMAS; print(json.dumps(SCHEMAS['nested']))" \
  > /tmp/nested.json
timeout 110 python3 -m moebus.cli bench decode --model $M --device cuda --batch 8 --tokens 128 --repeats 2 \
  --no-service --schema /tmp/nested.json 2>&1 | grep -v Warn | tee $OUT/schema.txt | tail -7
rm -rf $M
echo "== vision-cycle under 8 GiB (8 x 128 LLaVA, so400m)"; date
V=/tmp/a3b-8x128-vision
timeout 60 python3 -m moebus.cli init-model $V --preset a3b --layers 8 --vision siglip > /dev/null 2>&1
timeout 150 python3 -m moebus.cli bench vision-cycle --device cuda --model $V --gpu-memory-mib 8192 -v \
  --idle-s 3 --repeats 3 --text-streams 2 --text-tokens 64 --timeout-s 140 > $OUT/cycle.log 2>&1
grep -E "^\(|cold image|text streams|largest|warm image|target" $OUT/cycle.log
date
