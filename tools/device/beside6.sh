#!/usr/bin/env bash
# One H200 (~4-5 min; the first bench call compiles and captures on a cold kernel cache, the second
# loads them): issue 19 item 4, the gap of 8 running streams while a long prompt prefills
# (target: their median inter-token gap while an 8k prompt prefills at most 2x the gap without it).
# `bench decode --beside-prefill 2048,8192` on 48 x 32 A3B-shaped bf16 experts through the service,
# once per value of max_prefill_tokens_beside_decode in CAPS ("none": unset, the chunk of today:
# max_step_tokens less the decode rows). 64 keeps a mixed step of 8 decode rows above 64 tokens (the
# tensor-core path; shorter steps run the GEMVs, compiled per token count). Logs and JSON under $OUT.
source tools/device/setup.sh
set -o pipefail
M=/tmp/m48; CAPS=${CAPS:-"none 64"}
timeout 120 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $OUT/init_m.log 2>&1
for cap in $CAPS; do
  echo "== bench decode --beside-prefill 2048,8192, max_prefill_tokens_beside_decode $cap"; date
  if [ "$cap" = none ]; then unset MOEBUS_MAX_PREFILL_TOKENS_BESIDE_DECODE
  else export MOEBUS_MAX_PREFILL_TOKENS_BESIDE_DECODE=$cap; fi
  timeout 280 python3 -m moebus.cli bench decode --model $M --device cuda --batch 1 --tokens 2 --repeats 1 \
    --no-service --beside-prefill 2048,8192 --json 2>$OUT/beside_$cap.err | tee $OUT/beside_$cap.json | tail -c 600
  tail -3 $OUT/beside_$cap.err | grep -v Warn
done
unset MOEBUS_MAX_PREFILL_TOKENS_BESIDE_DECODE
date
python3 - $OUT $CAPS <<'PY'
import json, sys
out, caps = sys.argv[1], sys.argv[2:]
cols = ("gap_before_ms", "gap_during_ms", "gap_during_mean_ms", "gap_during_max_ms", "gap_ratio", "first_token_s",
        "prefill_tok_s", "during_steps", "during_step_ms", "during_compute_ms", "before_step_ms")
print(f"{'cap':>5} {'N':>5} " + " ".join(f"{c:>18}" for c in cols) + "  worker captures/eager short steps")
for cap in caps:
    try:
        row = json.loads(open(f"{out}/beside_{cap}.json").read().splitlines()[-1])
    except (OSError, IndexError, ValueError):
        print(f"{cap:>5}  no figures (see beside_{cap}.err)")
        continue
    for n in (2048, 8192):
        print(f"{cap:>5} {n:>5} " + " ".join(f"{row.get(f'beside{n}_{c}', '-')!s:>18}" for c in cols),
              row.get("beside_worker_graph_captures"), row.get("beside_worker_eager_short_steps"))
PY
