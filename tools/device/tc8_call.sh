#!/usr/bin/env bash
# One H200, branch tc8 (~250 s wall; sections in order of need, each only while the call's budget
# lasts): the GPU tests of the few-rows products, the decode tiles and the captured chunk steps while
# the 48 x 32 A3B model is written; then on it (bf16, bf16 KV, all resident unless said):
#   decode   tc8_decode.py: batch 1/4/8/16, experts GEMVs vs tiles x dense GEMVs vs tensor cores, one
#            process; then 8 decode rows beside a chunk of 8 / 16 / 32 prompt tokens at context 4k / 8k
#            (captured) against the decode step of 8;
#   (then beside, then prefill)
#   prefill  tc8_prefill.py: 2048 tokens, median of 5 (and 8192, of 3) all resident, then through a
#            25% cache, bench's prompt and prefill_cache_check's in one process each;
#   beside   bench decode --batch 1,8 (in-process, the defaults) and 8 streams beside 2048 / 8192
#            prompt tokens with max_prefill_tokens_beside_decode CAP (default 16).
# Logs under $OUT.
source tools/device/setup.sh
set -o pipefail
M=/tmp/m48; BUDGET=${BUDGET:-245}; CAP=${CAP:-16}; T0=$(date +%s)
now() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(now) )); }
have48() {  # a warm machine may hold it from an earlier call: written whole (generation_config.json last)
  [ -f $M/generation_config.json ] && python3 -c "import json,sys; c=json.load(open('$M/config.json'))
sys.exit(0 if (c['num_hidden_layers'], c['num_experts'], c['hidden_size'], c['moe_intermediate_size']) == (48, 32, 2048, 768) else 1)"
}
if have48; then echo "init48: kept from an earlier call at $(now) s" > $OUT/init48.log; else
(timeout 120 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $OUT/init48.log 2>&1
 echo "init48 rc=$? done at $(now) s" >> $OUT/init48.log) & fi
echo "== GPU tests at $(now) s"
MOEBUS_TEST_GPU=1 timeout 80 python3 -m pytest -q -rfE -p no:cacheprovider tests/cuda/test_decode_tensor_cores.py \
  tests/cuda/test_prefill_tensor_cores.py > $OUT/gpu_tests.txt 2>&1
echo "rc=$?"; grep -aE "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.txt | cut -c1-240 | head -8
wait; tail -1 $OUT/init48.log
if (( $(left) > 40 )); then
  echo "== decode, batch 1/4/8/16 and chunks beside 8 rows, at $(now) s"
  timeout $(( $(left) < 100 ? $(left) : 100 )) python3 tools/device/tc8_decode.py $M 1,4,8,16 16 8,16,32 4096,8176 2>&1 \
    | grep -av "Warn\|warn(" > $OUT/decode.txt
  echo "rc=$?"; grep -a -A40 "^batch" $OUT/decode.txt | grep -av "^{"
fi
if (( $(left) > 40 )); then
  echo "== beside 2048,8192, cap $CAP, at $(now) s"
  MOEBUS_MAX_PREFILL_TOKENS_BESIDE_DECODE=$CAP timeout $(( $(left) < 123 ? $(left) - 3 : 120 )) python3 -m moebus.cli bench decode --model $M \
    --device cuda --batch 1,8 --tokens 64 --repeats 2 --no-service --beside-prefill 2048,8192 --json \
    2>$OUT/beside.err > $OUT/beside.json
  echo "rc=$?"; grep -a "Error" $OUT/beside.err | tail -2
  python3 - $OUT/beside.json <<'PY'
import json, sys
try:
    rows = [json.loads(l) for l in open(sys.argv[1]).read().splitlines() if l.startswith("{")]
except (OSError, ValueError) as e:
    sys.exit(f"no figures: {e}")
for r in rows:
    short = {k: v for k, v in r.items() if k in ("batch", "tok_s", "ms_per_step") or (k.startswith("beside") and r is rows[0])}
    print(json.dumps(short))
PY
fi
if (( $(left) > 50 )); then
  echo "== prefill 2048 (and 8192), all resident and 25%, at $(now) s"
  timeout $(( $(left) < 80 ? $(left) : 80 )) python3 tools/device/tc8_prefill.py $M 2048 5 1,0.25 8192 2>&1 \
    | grep -av "Warn\|warn(" > $OUT/prefill.txt
  echo "rc=$?"; grep -a -A12 "^cache" $OUT/prefill.txt
fi
echo "end at $(now) s"
