# Issue 15, fifteenth session (branch decode15): decode attention at 32k context, merges with their loads in
# flight (attention_decode.WIDE_MERGE) and a decode split count of its own (DECODE_SPLITS).
# Run by the lead's call script twice (PHASE=warm side by side, then PHASE=measure alone, within BUDGET s).
# M48=/tmp/m48 is the lead's 48 x 32 a3b bf16 model.
# warm:    a 4 x 32 a3b model (/tmp/decode15-m4, ~1.4 GB); decode-context at 1k on it (compiles the bf16 b1 path),
#          then decode15_attn.py 0 (every setting compiled and run once: NMSE). Nothing timed.
# measure: decode15_attn.py (decode14_attn.py's CUPTI us a call of the one-launch decode attention at b1, 1k /
#          4k / 32k, per setting, BEST: the fastest at 32k with a good NMSE; then the us by kernel); bench
#          decode-context on M48 (1k, 4k, 32k, bf16 KV, 32 tokens, 2 repeats) with this tree's defaults, then
#          with BEST's setting (or, where BEST is the defaults, WIDE_MERGE=0); summary last. Settings tc*: the
#          tensor-core experiment (attention_decode.DECODE_TC: attention_decode_tc.cu + the merge apart).
source tools/device/setup.sh
BUDGET=${BUDGET:-86}; T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
at() { echo "$(( $(date +%s) - T0 )) s"; }
M4=/tmp/decode15-m4
SETTINGS=${SETTINGS:-"old:WIDE_MERGE=0 new: s128:DECODE_SPLITS=128 s256:DECODE_SPLITS=256
  apart256:MERGE_IN_SPLIT=0,DECODE_SPLITS=256,MERGE_SPLITS=16 tc64:DECODE_TC=1,SPLIT_POSITIONS=64
  tc128:DECODE_TC=1,DECODE_SPLITS=128,SPLIT_POSITIONS=64 tc256:DECODE_TC=1,DECODE_SPLITS=256"}
quiet() { grep -vE "Warn|warn\(" ; }
step() {  # NAME SECONDS_NEEDED SECONDS_AT_MOST COMMAND...: into $OUT/NAME.txt, its tail to stdout
  local name=$1 need=$2 most=$3 limit; shift 3
  [ $(left) -lt $need ] && { echo "== $name: skipped, $(left) s left"; return; }
  limit=$(( $(left) - 2 )); [ $limit -gt $most ] && limit=$most
  echo "== $name at $(at) (at most $limit s)"
  timeout $limit "$@" 2>&1 | quiet > $OUT/$name.txt
  echo "   rc ${PIPESTATUS[0]} at $(at)"; grep -vE "^\s*$" $OUT/$name.txt | tail -${SHOW:-12} | cut -c1-150
}
if [ "$PHASE" = warm ]; then
  [ $BUDGET -gt 120 ] && BUDGET=120
  [ -f $M4/.complete ] || { timeout 50 python3 -m moebus.cli init-model $M4 --preset a3b --layers 4 --experts 32 \
    2>&1 | tail -1 && touch $M4/.complete; }
  SHOW=4 step warm_context 15 45 python3 tools/device/decode14_context.py -- --model $M4 --device cuda --contexts 1024 \
    --kv-dtype bf16 --tokens 4 --repeats 1
  SHOW=8 step warm_attn 10 55 python3 tools/device/decode15_attn.py 0 $SETTINGS
  echo "warm done at $(at)"
  exit 0
fi
step attn 20 36 python3 tools/device/decode15_attn.py ${CALLS:-20} $SETTINGS
BEST_NAME=$(sed -n 's/^BEST \([^:]*\):.*/\1/p' $OUT/attn.txt 2>/dev/null | tail -1)
BEST=$(sed -n 's/^BEST [^:]*://p' $OUT/attn.txt 2>/dev/null | tail -1 | tr ',' ' ' | sed 's/\([A-Z_0-9]*=\)/attention_decode.\1/g')
CONTEXT_ARGS="--model $M48 --device cuda --contexts 1024,4096,32768 --kv-dtype bf16 --tokens 32 --repeats 2"
step context_new 20 25 python3 tools/device/decode14_context.py -- $CONTEXT_ARGS
if [ -n "$BEST" ]; then
  step context_best 18 25 python3 tools/device/decode14_context.py $BEST -- $CONTEXT_ARGS
elif [ "$BEST_NAME" = new ]; then
  step context_old 18 25 python3 tools/device/decode14_context.py attention_decode.WIDE_MERGE=0 -- $CONTEXT_ARGS
fi
echo "== summary at $(at) (BEST ${BEST_NAME:-none})"
grep -hE "^(old|new|s[0-9]|apart|tc)" $OUT/attn.txt 2>/dev/null | cut -c1-110
grep -hE "^  [0-9]+k " $OUT/attn.txt 2>/dev/null | cut -c1-160
for f in context_new context_best context_old; do
  [ -f $OUT/$f.txt ] || continue
  grep -hE "settings" $OUT/$f.txt | cut -c1-110
  awk '/^ +bf16/ {tok[$2]=$3} END {if (tok[1024] > 0) printf "   tok/s 1k %.1f  4k %.1f  32k %.1f  32k share of 1k %.3f\n", tok[1024], tok[4096], tok[32768], tok[32768] / tok[1024]}' $OUT/$f.txt
done
