# Issue 15, twelfth session (branch decode12): programmatic dependent launch (PDL) in the decode graph.
# Run by tools/device/lead12_call.sh twice (PHASE=warm side by side with other branches, then
# PHASE=measure alone, within BUDGET seconds). M48=/tmp/m48 is the lead's 48 x 32 a3b bf16 model.
# warm:    a 4 x 32 a3b model (/tmp/decode-m4, ~1.4 GB) and graph_check.py on it with MOEBUS_PDL on
#          (graph, with programmatic edges, == eager at batch 1 and 8, graph, launched ahead and with the
#          25% cache), which also compiles every kernel the measure phase runs; then, as time allows,
#          graph_check with the programmatic port, linear.PREFETCH_BEFORE_WAIT (the GEMVs' first weight
#          rows asked of L2 before the wait) and moe_ffn.PREFETCH_DOWN_BEFORE_WAIT (no cache), and
#          tests/cuda/test_pdl.py on the GPU (the micro model, both ports).
# measure: decode10_sweep.py on M48 with tools/device/decode12.json (PLAN=): bench decode's in-process
#          tok/s at batch 1 and 8 with MOEBUS_PDL 0 / programmatic / launch_order, with linear's weight
#          prefetch before the wait, and (programmatic) with moe_ffn's down prefetch too; each graph's
#          edge counts; PROFILE_STEPS (0) replayed steps a setting under CUPTI into $OUT/profiles.txt.
source tools/device/setup.sh
export MOEBUS_TEST_GPU=1
BUDGET=${BUDGET:-110}; T0=$(date +%s); PLAN=${PLAN:-tools/device/decode12.json}; STEPS=${PROFILE_STEPS:-0}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
M4=/tmp/decode-m4
if [ "$PHASE" = warm ]; then
  [ $BUDGET -gt 140 ] && BUDGET=140  # the task's warm allowance
  [ -f $M4/.complete ] || { timeout 40 python3 -m moebus.cli init-model $M4 --preset a3b --layers 4 --experts 32 \
    2>&1 | tail -1 && touch $M4/.complete; }
  echo "== graph_check 4 x 32, MOEBUS_PDL=programmatic, at $(( $(date +%s) - T0 )) s"
  MOEBUS_PDL=programmatic timeout $(( $(left) - 2 )) python3 tools/device/graph_check.py $M4 \
    > $OUT/graph_check_programmatic.txt 2>&1
  echo "graph_check rc $?"; grep -E "vs eager|CHECK|Error|PDL" $OUT/graph_check_programmatic.txt | head -10
  if [ $(left) -gt 45 ]; then echo "== graph_check MOEBUS_PDL=programmatic + both prefetches, at $(( $(date +%s) - T0 )) s"
    MOEBUS_PDL=programmatic timeout $(( $(left) - 2 )) python3 -c "import runpy, sys
from moebus.cuda.kernels import linear, moe_ffn
linear.PREFETCH_BEFORE_WAIT = moe_ffn.PREFETCH_DOWN_BEFORE_WAIT = True
sys.path.insert(0, 'tools/device'); sys.argv = ['graph_check.py', '$M4', '--no-cache']
runpy.run_path('tools/device/graph_check.py', run_name='__main__')" > $OUT/graph_check_prefetch.txt 2>&1
    echo "graph_check rc $?"; grep -E "vs eager|CHECK|Error|PDL" $OUT/graph_check_prefetch.txt | head -10; fi
  if [ $(left) -gt 30 ]; then echo "== GPU pytest test_pdl.py at $(( $(date +%s) - T0 )) s"
    timeout $(( $(left) - 2 )) python3 -m pytest -q -p no:cacheprovider tests/cuda/test_pdl.py -x 2>&1 | tail -15 \
      > $OUT/gpu_tests.txt; cat $OUT/gpu_tests.txt; fi
  echo "warm done at $(( $(date +%s) - T0 )) s"
  exit 0
fi
echo "== decode10_sweep $M48 $PLAN at $(( $(date +%s) - T0 )) s"
timeout $(( $(left) - 2 )) python3 tools/device/decode10_sweep.py $M48 $PLAN $STEPS $OUT/profiles.txt \
  2>&1 | grep -v Warn | tee $OUT/sweep.txt
echo "sweep rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 )) s"
grep -E "^   pdl |FAILED" $OUT/sweep.txt | cut -c1-200 | head -8
for port in programmatic prefetch; do echo "warm graph_check $port:"; cat $OUT/graph_check_$port.txt 2>/dev/null \
  | grep -E "vs eager|CHECK|Error|PDL" | head -8; done
echo "warm GPU tests:"; tail -3 $OUT/gpu_tests.txt 2>/dev/null
