# Issue 15, sixteenth session (branch decode16): batch 1 back above 300 tok/s. The tensor-core decode attention
# (attention_decode.DECODE_TC) with this session's defaults ("new"): TC_PDL (the kernel waits first in every block,
# so the decode graph's edge into it is programmatic) and TC_MERGE_IN_SPLIT where a token of the cache has at most
# TC_MERGE_MAX_SPLITS (2) splits (a token of one split writes its output directly, else the last split block
# merges; no merge_splits launch), against the fifteenth session's ("old": both off, the merge apart), the merge in
# the split kernel at any split count (tcm: TC_MERGE_MAX_SPLITS=256) and the numba kernel (DECODE_TC=0).
# Call A (sixteenth session) ran an earlier form of this script, with every switch off by default; this is the form
# for call B: the final check of the defaults flipped after it.
# Run by the lead's call script twice (PHASE=warm side by side, then PHASE=measure alone, within BUDGET s).
# M48=/tmp/m48 is the lead's 48 x 32 a3b bf16 model. The timed-step helpers come from tools/device/steps.sh.
# warm:    a 4 x 32 a3b model (/tmp/decode16-m4, ~1.4 GB); greedy decode on it at b1 and b4 over 1-4 splits with
#          each setting in one process (decode16_check.py: every kernel of the b1 runs compiled; tokens and logprobs
#          against the defaults' bit for bit; the graphs' PDL counts), decode16_attn.py 0 (the attention settings
#          compiled; bits against the defaults), then the GPU tests of the tensor-core decode
#          (test_attention_decode_tc.py: the merge in the split kernel gives the merge apart's bits, the counters
#          back at 0, the kernel that waits first the same bits).
# measure: one process (decode13_bench.py, THEN): b1 on M48 with new, old, new, old, new, + TC_GRID_SPLITS, then
#          TC_SPLIT_POSITIONS 128 (bench decode's positions in one split), numba in turn, the graphs recaptured
#          between (b1 median of 3, the PDL edges converted); then `bench decode --model $M48 --batch 1 --tokens 64
#          --repeats 3 --no-service` with new in a process of its own (decode16_bench.py); the attention alone
#          (decode16_attn.py: CUPTI us a call at 64 / 96 / 1k / 32k positions, by kernel, bits against new; pos128:
#          128 positions a split); old in a process of its own as time allows; summary last.
source tools/device/setup.sh
BUDGET=${BUDGET:-116}; T0=$(date +%s)
source tools/device/steps.sh
M4=/tmp/decode16-m4
TC=attention_decode.DECODE_TC; MERGE=attention_decode.TC_MERGE_IN_SPLIT; PDL=attention_decode.TC_PDL
GRID=attention_decode.TC_GRID_SPLITS; MAXS=attention_decode.TC_MERGE_MAX_SPLITS; POS=attention_decode.TC_SPLIT_POSITIONS
SETTINGS=${SETTINGS:-"new: old:TC_MERGE_IN_SPLIT=0,TC_PDL=0 tcm:TC_MERGE_MAX_SPLITS=256 pos128:TC_SPLIT_POSITIONS=128
  numba:DECODE_TC=0"}
export CONTEXTS=${CONTEXTS:-64,96,1024,32768}
if [ "$PHASE" = warm ]; then
  [ $BUDGET -gt 120 ] && BUDGET=120
  [ -f $M4/.complete ] || { timeout 50 python3 -m moebus.cli init-model $M4 --preset a3b --layers 4 --experts 32 \
    2>&1 | tail -1 && touch $M4/.complete; }
  SHOW=6 step check 15 70 python3 tools/device/decode16_check.py $M4 new: old:$MERGE=0,$PDL=0 \
    all:$MERGE=1,$PDL=1,$GRID=1,$MAXS=256 numba:$TC=0
  SHOW=6 step warm_attn 8 25 python3 tools/device/decode16_attn.py 0 $SETTINGS
  SHOW=6 step warm_tests 10 60 env MOEBUS_TEST_GPU=1 python3 -m pytest -q -rfE -p no:cacheprovider \
    tests/cuda/test_attention_decode_tc.py
  echo "warm done at $(at)"
  exit 0
fi
BENCH="--model $M48 --device cuda --batch 1 --tokens 64 --repeats 3 --no-service"
b1() { local name=$1; shift; SHOW=3 step $name 18 40 python3 tools/device/decode16_bench.py decode "$@" -- $BENCH; }
OLD="$MERGE=0 $PDL=0"; NEW="$MERGE=1 $PDL=1"  # the fifteenth session's defaults, this session's
# one process, one model load: the defaults, then old / new in turn (groups applied on top of the ones before), the
# graphs recaptured between them (decode13_bench.py's THEN: b1 median of 3 runs, the graphs' PDL edges converted)
SHOW=30 step inter 25 50 env THEN="$OLD; $NEW; $OLD; $NEW; $GRID=1; $GRID=0 $POS=128; $POS=64 $TC=0" \
  python3 tools/device/decode13_bench.py $M48 inter 3 1
b1 b1_new
step attn 12 30 python3 tools/device/decode16_attn.py ${CALLS:-20} $SETTINGS
b1 b1_old $OLD
short() { sed -e "s/attention_decode\.//g; s/TC_MERGE_IN_SPLIT/M/g; s/TC_PDL/P/g; s/TC_GRID_SPLITS/G/g; s/DECODE_TC/TC/g;
  s/TC_SPLIT_POSITIONS/POS/g; s/TC_MERGE_MAX_SPLITS/MAXS/g"; }
echo "== summary at $(at) (b1: tok/s, ms a step; M: TC_MERGE_IN_SPLIT, P: TC_PDL, G: TC_GRID_SPLITS; attention: us a call at $CONTEXTS)"
for f in b1_new b1_old; do
  [ -f $OUT/$f.txt ] && awk -v n=$f '/^settings:/ {s = substr($0, 11)} /^ +1 +[0-9.]+ +[0-9.]+/ {
    printf "%-9s %7.1f tok/s %6.3f ms  [%s]\n", n, $2, $3, s}' $OUT/$f.txt | short
done
grep -hE "b1 +[0-9.]+ tok/s|pdl converted" $OUT/inter.txt 2>/dev/null | short | sed -e "s/ (runs [^)]*)//; s/; load.*\]/]/" | cut -c1-110
grep -hE "^(new|old|tcm|pos128|numba) " $OUT/attn.txt 2>/dev/null | cut -c1-120
grep -hE "^  [0-9]+k |^bits " $OUT/attn.txt 2>/dev/null | cut -c1-200
grep -hE "^check " $OUT/check.txt 2>/dev/null | short | cut -c1-200  # the warm phase's
grep -hE "passed|failed|^(FAILED|ERROR)" $OUT/warm_tests.txt 2>/dev/null | cut -c1-200 | tail -4
