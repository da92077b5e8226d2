# Issue 15, fourteenth session (branch decode14): the cuBLAS workspace set again after every set_stream (batch
# 8's graphs without alloc nodes, so PDL converts them); the decode attention's settings at 32k context.
# Run by the lead's call script twice (PHASE=warm side by side, then PHASE=measure alone, within BUDGET s).
# M48=/tmp/m48 is the lead's 48 x 32 a3b bf16 model.
# warm:    a 4 x 32 a3b model (/tmp/decode14-m4, ~1.4 GB); on it decode-context at 1k (compiles the bf16 b1
#          path), decode14_b8check.py (b8 graphs with PDL off, with the default PDL, eager: the same bits?
#          and the edge counts: whether b8's graphs still hold alloc nodes), decode14_attn.py 0 (every
#          attention setting compiled), then graph_check.py --no-cache as time allows. Nothing timed.
# measure: decode14_attn.py (CUPTI us a call of the one-launch decode attention at b1, 1k / 4k / 32k, per
#          setting; BEST: the fastest at 32k with a good NMSE); bench decode-context on M48 (1k, 4k, 32k, bf16
#          KV, 32 tokens, 2 repeats) with the defaults, then with BEST's setting; decode13_bench.py at b8 with
#          PDL (the default) and with PDL off.
source tools/device/setup.sh
BUDGET=${BUDGET:-121}; T0=$(date +%s)
source tools/device/steps.sh  # left, at, quiet, step
M4=/tmp/decode14-m4
O=OWNER_SOFTMAX=1,FAST_EXP=1  # the owner softmax in base 2
SETTINGS=${SETTINGS:-"base: owner_fast:$O owner_fast_l2_64:$O,L2_AHEAD=64,MIN_BLOCKS=2 owner_fast_h8:$O,MAX_HEADS_PER_WARP=8
  fast_l2_64:FAST_EXP=1,L2_AHEAD=64,MIN_BLOCKS=2 owner:OWNER_SOFTMAX=1
  owner_fast_h8_l2_64:$O,MAX_HEADS_PER_WARP=8,L2_AHEAD=64,MIN_BLOCKS=2 owner_fast_ahead4:$O,ROWS_AHEAD=4,MIN_BLOCKS=2
  owner_fast_l2_128:$O,L2_AHEAD=128,MIN_BLOCKS=2 fast:FAST_EXP=1"}
if [ "$PHASE" = warm ]; then
  [ $BUDGET -gt 120 ] && BUDGET=120
  [ -f $M4/.complete ] || { timeout 50 python3 -m moebus.cli init-model $M4 --preset a3b --layers 4 --experts 32 \
    2>&1 | tail -1 && touch $M4/.complete; }
  SHOW=4 step warm_context 15 40 python3 tools/device/decode14_context.py -- --model $M4 --device cuda --contexts 1024 \
    --kv-dtype bf16 --tokens 4 --repeats 1
  SHOW=5 step warm_b8 15 40 python3 tools/device/decode14_b8check.py $M4 8 16
  SHOW=12 step warm_attn 10 60 python3 tools/device/decode14_attn.py 0 $SETTINGS
  SHOW=12 step graph_check 25 60 python3 tools/device/graph_check.py $M4 --no-cache
  echo "warm done at $(at)"
  exit 0
fi
step attn 30 50 python3 tools/device/decode14_attn.py 30 $SETTINGS
BEST=$(sed -n 's/^BEST [^:]*://p' $OUT/attn.txt 2>/dev/null | tail -1 | tr ',' ' ' | sed 's/\([A-Z_0-9]*=\)/attention_decode.\1/g')
CONTEXT_ARGS="--model $M48 --device cuda --contexts 1024,4096,32768 --kv-dtype bf16 --tokens 32 --repeats 2"
step context_base 20 35 python3 tools/device/decode14_context.py -- $CONTEXT_ARGS
[ -n "$BEST" ] && step context_best 20 35 python3 tools/device/decode14_context.py $BEST -- $CONTEXT_ARGS
step b8_pdl 18 30 python3 tools/device/decode13_bench.py $M48 "b8 pdl (default)" 1 8
MOEBUS_PDL=0 step b8_nopdl 18 30 python3 tools/device/decode13_bench.py $M48 "b8 pdl off" 1 8
echo "== summary at $(at)"
grep -hE "^(base|fast|l2|owner|ahead|h[0-9])" $OUT/attn.txt 2>/dev/null | cut -c1-110
for f in context_base context_best; do grep -hE "settings|^ +bf16" $OUT/$f.txt 2>/dev/null | cut -c1-110; done
grep -hE "tok/s|converted" $OUT/b8_pdl.txt $OUT/b8_nopdl.txt 2>/dev/null | cut -c1-150
grep -hE "bits|DIFFERENT" $OUT/warm_b8.txt 2>/dev/null | cut -c1-120  # the warm phase's, when it shares $OUT
