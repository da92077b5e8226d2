# Issue 15, thirteenth session (branch decode13): PDL that survives graphs the driver will not edit,
# cuBLAS's own workspace (no alloc nodes in batch 8's graph), MOEBUS_PDL_TRIGGER (launch_dependents after
# every wait). Run by the lead's call script twice (PHASE=warm side by side, then PHASE=measure alone,
# within BUDGET s). M48=/tmp/m48 is the lead's 48 x 32 a3b bf16 model.
# warm:    a 4 x 32 a3b model (/tmp/decode13-m4, ~1.4 GB); graph_check.py on it (graph, launched ahead,
#          25% cache == eager, batch 1 and 8) with MOEBUS_PDL=programmatic, then with the trigger too: this
#          compiles both kernel variants (the trigger has its own kernel-cache fingerprint); then the trigger
#          with linear's and moe_ffn's weight prefetches before the wait and the down GEMV pipelined
#          (moe_ffn.DOWN_BLOCKS_SHORT=DOWN_BLOCKS, DOWN_PREFETCH_NEXT; --no-cache), as time allows.
# measure: tools/device/decode13_bench.py on M48, each PDL setting in its own process: b1 REPEATS runs (median),
#          b8 once where listed; PDL off (a CUPTI profile of PROFILE_STEPS b1 steps by kernel into
#          $OUT/profiles.txt), then in the same process the down GEMV pipelined, DOWN_BLOCKS then 64 blocks
#          (each profiled too); programmatic +
#          trigger (b1, b8); trigger + both prefetches, then + the down GEMV pipelined; programmatic;
#          launch_order (the last ones as the budget allows).
source tools/device/setup.sh
BUDGET=${BUDGET:-116}; T0=$(date +%s); REPEATS=${REPEATS:-3}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
at() { echo "$(( $(date +%s) - T0 )) s"; }
M4=/tmp/decode13-m4
DOWN_BLOCKS=${DOWN_BLOCKS:-128}  # moe_ffn.DOWN_BLOCKS_SHORT of the pipelined down rows (~1 wave at batch 1)
show() { grep -E "vs eager|CHECK|Error|PDL|refused" "$1" | cut -c1-200 | head -12; }
if [ "$PHASE" = warm ]; then
  [ $BUDGET -gt 130 ] && BUDGET=130
  [ -f $M4/.complete ] || { timeout 45 python3 -m moebus.cli init-model $M4 --preset a3b --layers 4 --experts 32 \
    2>&1 | tail -1 && touch $M4/.complete; }
  echo "== graph_check 4 x 32, MOEBUS_PDL=programmatic, at $(at)"
  MOEBUS_PDL=programmatic timeout $(( $(left) - 2 )) python3 tools/device/graph_check.py $M4 \
    > $OUT/graph_check_programmatic.txt 2>&1
  echo "graph_check rc $?"; show $OUT/graph_check_programmatic.txt
  if [ $(left) -gt 25 ]; then echo "== graph_check MOEBUS_PDL=programmatic MOEBUS_PDL_TRIGGER=1, at $(at)"
    MOEBUS_PDL=programmatic MOEBUS_PDL_TRIGGER=1 timeout $(( $(left) - 2 )) python3 tools/device/graph_check.py $M4 \
      > $OUT/graph_check_trigger.txt 2>&1
    echo "graph_check rc $?"; show $OUT/graph_check_trigger.txt; fi
  if [ $(left) -gt 25 ]; then echo "== graph_check trigger + both prefetches + down pipelined, --no-cache, at $(at)"
    MOEBUS_PDL=programmatic MOEBUS_PDL_TRIGGER=1 timeout $(( $(left) - 2 )) python3 -c "import runpy, sys
from moebus.cuda.kernels import linear, moe_ffn
linear.PREFETCH_BEFORE_WAIT = moe_ffn.PREFETCH_DOWN_BEFORE_WAIT = moe_ffn.DOWN_PREFETCH_NEXT = True
moe_ffn.DOWN_BLOCKS_SHORT = $DOWN_BLOCKS
sys.path.insert(0, 'tools/device'); sys.argv = ['graph_check.py', '$M4', '--no-cache']
runpy.run_path('tools/device/graph_check.py', run_name='__main__')" > $OUT/graph_check_prefetch.txt 2>&1
    echo "graph_check rc $?"; show $OUT/graph_check_prefetch.txt; fi
  echo "warm done at $(at)"
  exit 0
fi
export PROFILE_FILE=$OUT/profiles.txt
run() {  # NAME BATCHES [KEY=VALUE...]: one setting, one process, the environment as the caller set it
  local name=$1 batches=$2; shift 2
  [ $(left) -lt 25 ] && { echo "$name: skipped, $(left) s left"; return; }
  timeout $(( $(left) - 2 )) python3 tools/device/decode13_bench.py $M48 "$name" $REPEATS $batches "$@" 2>&1 \
    | grep -vE "Warn|warn\(" | tee -a $OUT/bench.txt
  echo "   rc ${PIPESTATUS[0]} at $(at)"
}
echo "== decode13_bench on $M48, b1 median of $REPEATS, at $(at)"
PIPE="moe_ffn.DOWN_PREFETCH_NEXT=1 moe_ffn.DOWN_BLOCKS_SHORT=$DOWN_BLOCKS"  # the down GEMV pipelined
PREF="linear.PREFETCH_BEFORE_WAIT=1 moe_ffn.PREFETCH_DOWN_BEFORE_WAIT=1"  # weights asked of L2 before the wait
MOEBUS_PDL=0 PROFILE_STEPS=${PROFILE_STEPS:-3} THEN="$PIPE; moe_ffn.DOWN_BLOCKS_SHORT=64" run "pdl off" 1,8
MOEBUS_PDL=programmatic MOEBUS_PDL_TRIGGER=1 run "programmatic + trigger" 1,8
MOEBUS_PDL=programmatic MOEBUS_PDL_TRIGGER=1 THEN="$PIPE" run "trigger + both prefetches" 1 $PREF
MOEBUS_PDL=programmatic run "programmatic" 1
MOEBUS_PDL=launch_order run "launch_order" 1
for f in programmatic trigger prefetch; do echo "warm graph_check $f:"
  grep -E "vs eager|CHECK|refused|keeps its plain" $OUT/graph_check_$f.txt 2>/dev/null | cut -c1-100 | head -8; done
echo "== summary at $(at)"; grep -E "tok/s|refused|FAILED|Error" $OUT/bench.txt | cut -c1-130
