# Issue 15, sixteenth session (branch decode16): batch 1 back above 300 tok/s. The tensor-core decode attention
# merging in its split kernel (attention_decode.TC_MERGE_IN_SPLIT, off by default: a token of one split writes
# its output directly, else the last split block merges; no merge_splits launch, 48 fewer kernels a step)
# against the merge apart (DECODE_TC=1, the fifteenth session's default) and the numba kernel (DECODE_TC=0).
# Run by the lead's call script twice (PHASE=warm side by side, then PHASE=measure alone, within BUDGET s).
# M48=/tmp/m48 is the lead's 48 x 32 a3b bf16 model. The timed-step helpers come from tools/device/steps.sh.
# warm:    a 4 x 32 a3b model (/tmp/decode16-m4, ~1.4 GB); greedy decode on it at b1 and b4 over 1-3 splits
#          with each setting in one process (decode16_check.py: every kernel of the b1 runs compiled; tcm's tokens
#          and logprobs must be tc's bits), decode16_attn.py 0 (the attention settings compiled; bits against the
#          default), then the GPU tests of the tensor-core decode (test_attention_decode_tc.py: the merge in the
#          split kernel gives the merge apart's bits, the counters back at 0). TC_PDL (off by default): the
#          tensor-core kernel waits first in every block, so the decode graph's edge into it is programmatic (the
#          check prints the graphs' PDL counts: with it, 4 more waiting kernel nodes a graph of the 4-layer model).
# measure: `bench decode --model $M48 --batch 1 --tokens 64 --repeats 3 --no-service` with the default (tc) and
#          the three switches on (all: TC_MERGE_IN_SPLIT, TC_PDL, TC_GRID_SPLITS), each in a process of its own
#          (decode16_bench.py), after one process (decode13_bench.py, THEN) with tc, all, tc, tcm, tcp, tcm+tcp, all,
#          tc, all at 128 positions a split and numba in turn, the graphs recaptured between (b1 median of 3, the
#          PDL edges converted); the attention alone (decode16_attn.py: CUPTI us a call at 64 / 96 / 1k / 32k
#          positions, by kernel, bits); as time allows tcm, tcp and numba in processes of their own; summary last.
source tools/device/setup.sh
BUDGET=${BUDGET:-116}; T0=$(date +%s)
source tools/device/steps.sh
M4=/tmp/decode16-m4
TC=attention_decode.DECODE_TC; MERGE=attention_decode.TC_MERGE_IN_SPLIT; PDL=attention_decode.TC_PDL
GRID=attention_decode.TC_GRID_SPLITS; POS=attention_decode.TC_SPLIT_POSITIONS
SETTINGS=${SETTINGS:-"tc: tcm:TC_MERGE_IN_SPLIT=1 tcg:TC_MERGE_IN_SPLIT=1,TC_GRID_SPLITS=1 numba:DECODE_TC=0"}
export CONTEXTS=${CONTEXTS:-64,96,1024,32768}
if [ "$PHASE" = warm ]; then
  [ $BUDGET -gt 120 ] && BUDGET=120
  [ -f $M4/.complete ] || { timeout 50 python3 -m moebus.cli init-model $M4 --preset a3b --layers 4 --experts 32 \
    2>&1 | tail -1 && touch $M4/.complete; }
  SHOW=6 step check 15 70 python3 tools/device/decode16_check.py $M4 tc: tcm:$MERGE=1 tcmp:$PDL=1 tcp:$MERGE=0 \
    all:$MERGE=1,$GRID=1 numba:$PDL=0,$TC=0
  SHOW=6 step warm_attn 8 25 python3 tools/device/decode16_attn.py 0 $SETTINGS
  SHOW=6 step warm_tests 10 60 env MOEBUS_TEST_GPU=1 python3 -m pytest -q -rfE -p no:cacheprovider \
    tests/cuda/test_attention_decode_tc.py
  echo "warm done at $(at)"
  exit 0
fi
BENCH="--model $M48 --device cuda --batch 1 --tokens 64 --repeats 3 --no-service"
b1() { local name=$1; shift; SHOW=3 step $name 18 40 python3 tools/device/decode16_bench.py decode "$@" -- $BENCH; }
ALL="$MERGE=1 $PDL=1 $GRID=1"
# one process, one model load: each setting in turn (groups applied on top of the ones before), the graphs recaptured
# between them (decode13_bench.py's THEN: b1 median of 3 runs, the graphs' PDL edges converted), against drift;
# then TC_SPLIT_POSITIONS 128 (bench decode's positions 32..95 in one split: no merge at all)
SHOW=30 step inter 25 50 env THEN="$ALL; $MERGE=0 $PDL=0 $GRID=0; $MERGE=1; $MERGE=0 $PDL=1; $MERGE=1; $GRID=1;
  $MERGE=0 $PDL=0 $GRID=0; $ALL $POS=128; $POS=64 $TC=0" python3 tools/device/decode13_bench.py $M48 inter 3 1
b1 b1_all $ALL
b1 b1_tc
step attn 12 30 python3 tools/device/decode16_attn.py ${CALLS:-20} $SETTINGS
b1 b1_tcm $MERGE=1
b1 b1_tcp $PDL=1
b1 b1_numba $TC=0
short() { sed -e "s/attention_decode\.//g; s/TC_MERGE_IN_SPLIT/M/g; s/TC_PDL/P/g; s/TC_GRID_SPLITS/G/g; s/DECODE_TC/TC/g;
  s/TC_SPLIT_POSITIONS/POS/g"; }
echo "== summary at $(at) (b1: tok/s, ms a step; M: TC_MERGE_IN_SPLIT, P: TC_PDL, G: TC_GRID_SPLITS; attention: us a call at $CONTEXTS)"
for f in b1_tc b1_all b1_tcm b1_tcp b1_numba; do
  [ -f $OUT/$f.txt ] && awk -v n=$f '/^settings:/ {s = substr($0, 11)} /^ +1 +[0-9.]+ +[0-9.]+/ {
    printf "%-9s %7.1f tok/s %6.3f ms  [%s]\n", n, $2, $3, s}' $OUT/$f.txt | short
done
grep -hE "b1 +[0-9.]+ tok/s|pdl converted" $OUT/inter.txt 2>/dev/null | short | sed -e "s/ (runs [^)]*)//; s/; load.*\]/]/" | cut -c1-110
grep -hE "^(tc|tcm|tcg|numba) " $OUT/attn.txt 2>/dev/null | cut -c1-120
grep -hE "^  [0-9]+k |^bits " $OUT/attn.txt 2>/dev/null | cut -c1-200
grep -hE "^check " $OUT/check.txt 2>/dev/null | short | cut -c1-200  # the warm phase's
grep -hE "passed|failed|^(FAILED|ERROR)" $OUT/warm_tests.txt 2>/dev/null | cut -c1-200 | tail -4
