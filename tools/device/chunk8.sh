#!/usr/bin/env bash
# One H200 (~7-9 min wall; not yet run), issue 19 item 4, branch chunk8: the tile kernel for a routed
# step's chunk beside decode rows (moebus/cuda/kernels/attention_chunk.py, MOEBUS_CHUNK_ATTENTION).
#   tests    the chunk kernel's and the decode kernel's GPU tests, the captured chunk steps;
#   kernel   chunk8_attention.py: one layer's attention of 8 decode rows + a chunk of 8/16/32 at
#            P 4096/8176, decode kernel vs tile kernel (us, and the outputs' largest difference);
#   steps    tc8_decode.py's table (8 decode rows beside a chunk of 16/32 at 4k/8k, 48 x 32 A3B,
#            captured) with MOEBUS_CHUNK_ATTENTION=0 then 1, one process each (its decode part at
#            batch 1 only, 4 steps: the mixed steps always have 8 decode rows);
#   beside   bench decode --beside-prefill 8192 (8 streams) at caps 16 and 32, the switch on.
# Sections in order, each only while BUDGET (s) lasts (cap 32 needs BUDGET ~560). Logs under $OUT.
source tools/device/setup.sh
set -o pipefail
M=/tmp/m48; BUDGET=${BUDGET:-420}; CAPS=${CAPS:-"16 32"}; T0=$(date +%s)
now() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(now) )); }
cap_s() { local l=$(left); echo $(( l < $1 ? l - 3 : $1 )); }  # a section's timeout: its own or what is left
[ -f $M/generation_config.json ] || (timeout 120 python3 -m moebus.cli init-model $M --preset a3b --layers 48 \
  --experts 32 > $OUT/init48.log 2>&1; echo "init48 rc=$? at $(now) s" >> $OUT/init48.log) &
echo "== GPU tests at $(now) s"
MOEBUS_TEST_GPU=1 timeout 90 python3 -m pytest -q -rfE -p no:cacheprovider tests/cuda/test_attention_chunk.py \
  tests/cuda/test_attention.py tests/cuda/test_decode_tensor_cores.py > $OUT/gpu_tests.txt 2>&1
echo "rc=$?"; grep -aE "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.txt | cut -c1-240 | head -8
echo "== one layer's attention, decode kernel vs tile kernel, at $(now) s"
timeout 60 python3 tools/device/chunk8_attention.py 0,8,16,32 4096,8176 50 2>&1 | grep -av "Warn\|warn(" \
  | tee $OUT/kernel.txt
wait; tail -1 $OUT/init48.log
for switch in 0 1; do
  (( $(left) > 60 )) || break
  echo "== 8 decode rows beside a chunk, MOEBUS_CHUNK_ATTENTION=$switch, at $(now) s"
  MOEBUS_CHUNK_ATTENTION=$switch timeout $(cap_s 100) python3 tools/device/tc8_decode.py $M 1 4 16,32 4096,8176 2>&1 \
    | grep -av "Warn\|warn(" > $OUT/steps_$switch.txt
  echo "rc=$?"; grep -a -A8 "^chunk" $OUT/steps_$switch.txt
done
for cap in $CAPS; do
  (( $(left) > 60 )) || break
  echo "== 8 streams beside 8192, cap $cap, switch on, at $(now) s"
  MOEBUS_CHUNK_ATTENTION=1 MOEBUS_MAX_PREFILL_TOKENS_BESIDE_DECODE=$cap timeout $(cap_s 150) python3 -m moebus.cli bench decode --model $M \
    --device cuda --batch 8 --tokens 16 --repeats 1 --no-service --beside-prefill 8192 --json \
    2>$OUT/beside_$cap.err > $OUT/beside_$cap.json
  echo "rc=$?"; grep -a "Error" $OUT/beside_$cap.err | tail -2 | cut -c1-240
  python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().splitlines()[-1]); \
print({k: v for k, v in r.items() if k.startswith('beside') or k in ('batch', 'tok_s')})" $OUT/beside_$cap.json
done
echo "end at $(now) s"
