#!/usr/bin/env bash
# One H200 (~3-4 min per cap; not yet run): issue 19 item 4 through the service, what tc8_call.sh's
# 120 s section could not finish: 8 streams beside 2048 / 8192 prompt tokens, once per
# max_prefill_tokens_beside_decode in CAPS (default "8 16"). tc8_call.sh measured the steps in-process
# (8 decode rows + a chunk of C at context 4k / 8k, captured): C 8 -> 1.78x / 2.10x the decode step
# of 8, C 16 -> 2.43x / 2.87x. Logs under $OUT.
source tools/device/setup.sh
set -o pipefail
M=/tmp/m48; CAPS=${CAPS:-"8 16"}; T0=$(date +%s)
now() { echo $(( $(date +%s) - T0 )); }
[ -f $M/generation_config.json ] || timeout 120 python3 -m moebus.cli init-model $M --preset a3b --layers 48 \
  --experts 32 > $OUT/init48.log 2>&1
for cap in $CAPS; do
  echo "== beside 2048,8192, cap $cap, at $(now) s"
  MOEBUS_MAX_PREFILL_TOKENS_BESIDE_DECODE=$cap timeout 240 python3 -m moebus.cli bench decode --model $M --device cuda \
    --batch 8 --tokens 16 --repeats 1 --no-service --beside-prefill 2048,8192 --json 2>$OUT/beside_$cap.err \
    > $OUT/beside_$cap.json
  echo "rc=$?"; tail -3 $OUT/beside_$cap.err | cut -c1-240
  python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().splitlines()[-1]); \
print({k: v for k, v in r.items() if k.startswith('beside')})" $OUT/beside_$cap.json
done
echo "end at $(now) s"
