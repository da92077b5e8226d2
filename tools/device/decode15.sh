# Issue 15, fifteenth session (branch decode15): decode attention at 32k context on tensor cores
# (attention_decode.DECODE_TC, on by default after call A: attention_decode_tc.cu + the merge apart), the numba
# kernel's merges with their loads in flight (WIDE_MERGE) and a decode split count of its own (DECODE_SPLITS).
# Run by the lead's call script twice (PHASE=warm side by side, then PHASE=measure alone, within BUDGET s).
# M48=/tmp/m48 is the lead's 48 x 32 a3b bf16 model.
# warm:    a 4 x 32 a3b model (/tmp/decode15-m4, ~1.4 GB); decode-context at 1k on it (compiles the bf16 b1 path
#          with the defaults), then decode15_attn.py 0 (the settings' attention kernels compiled, NMSE). Nothing timed.
# measure: bench decode-context on M48 (1k, 4k, 32k, bf16 KV, 32 tokens, 2 repeats) with this tree's defaults
#          first (the final check); decode15_attn.py (decode14_attn.py's CUPTI us a call of the decode attention at
#          b1, 1k / 4k / 32k, per setting, then by kernel); decode-context with the numba kernel (DECODE_TC=0) as
#          time allows; summary last. SETTINGS: call A's were old / new / s128 / s256 / apart256 / tc64 / tc128 /
#          tc256 (docs/performance.md, fifteenth session).
source tools/device/setup.sh
BUDGET=${BUDGET:-86}; T0=$(date +%s)
source tools/device/steps.sh  # left, at, quiet, step
M4=/tmp/decode15-m4
SETTINGS=${SETTINGS:-"numba_old:DECODE_TC=0,WIDE_MERGE=0 numba:DECODE_TC=0 tc: tc128:DECODE_SPLITS=128"}
if [ "$PHASE" = warm ]; then
  [ $BUDGET -gt 120 ] && BUDGET=120
  [ -f $M4/.complete ] || { timeout 50 python3 -m moebus.cli init-model $M4 --preset a3b --layers 4 --experts 32 \
    2>&1 | tail -1 && touch $M4/.complete; }
  SHOW=4 step warm_context 15 80 python3 tools/device/decode14_context.py -- --model $M4 --device cuda --contexts 1024 \
    --kv-dtype bf16 --tokens 4 --repeats 1
  SHOW=8 step warm_attn 8 55 python3 tools/device/decode15_attn.py 0 $SETTINGS
  echo "warm done at $(at)"
  exit 0
fi
CONTEXT_ARGS="--model $M48 --device cuda --contexts 1024,4096,32768 --kv-dtype bf16 --tokens 32 --repeats 2"
step context_new 25 55 python3 tools/device/decode14_context.py -- $CONTEXT_ARGS
step attn 12 30 python3 tools/device/decode15_attn.py ${CALLS:-20} $SETTINGS
step context_numba 22 40 python3 tools/device/decode14_context.py attention_decode.DECODE_TC=0 -- $CONTEXT_ARGS
echo "== summary at $(at)"
grep -hE "^(numba|tc)" $OUT/attn.txt 2>/dev/null | cut -c1-110
grep -hE "^  [0-9]+k " $OUT/attn.txt 2>/dev/null | cut -c1-160
for f in context_new context_numba; do
  [ -f $OUT/$f.txt ] || continue
  grep -hE "settings" $OUT/$f.txt | cut -c1-110
  awk '/^ +bf16/ {tok[$2]=$3} END {if (tok[1024] > 0) printf "   tok/s 1k %.1f  4k %.1f  32k %.1f  32k share of 1k %.3f\n", tok[1024], tok[4096], tok[32768], tok[32768] / tok[1024]}' $OUT/$f.txt
done
