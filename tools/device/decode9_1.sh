# Issue 15 item 1, ninth session (branch decode9): the call it owes (~200 s on one H200; not run in
# the session: both starts it asked for failed). The GPU tests of in-process launch-ahead
# (LocalModel.decode) and of norm_route's one-token tail by ranks, graph == eager (4 x 32, with steps
# launched ahead and a 25% cache), then decode9_sweep.py on 48 x 32 over decode9_1.json: bench
# decode's in-process tok/s at batch 1 and 8 with launch-ahead on and off, each setting's per-kernel
# profile, and a CUPTI trace of steps launched ahead (the GPU's idle time between steps).
# QUICK=1: ~140 s (graph_check without the 25% cache, only the new tests, three settings).
source tools/device/setup.sh
export MOEBUS_TEST_GPU=1
M=/tmp/m48
timeout 100 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $OUT/init48.log 2>&1 &
timeout 30 python3 -m moebus.cli init-model /tmp/m4 --preset a3b --layers 4 --experts 32 2>&1 | tail -1
echo "== GPU tests, graph == eager (4 x 32)"; date
if [ -n "$QUICK" ]; then GC_ARGS=--no-cache; K="one_token or local_decode"; T=50; SWEEP=80; SETTINGS=decode9_quick.json
else GC_ARGS=; K=; T=80; SWEEP=110; SETTINGS=decode9_1.json; fi
timeout $T python3 tools/device/graph_check.py /tmp/m4 $GC_ARGS > $OUT/graph_check.txt 2>&1 & GC=$!
timeout $T python3 -m pytest -q -p no:cacheprovider tests/cuda/test_routing.py tests/cuda/test_launch_ahead.py \
  ${K:+-k "$K"} 2>&1 | tee $OUT/tests.txt | tail -4
wait $GC; echo "graph_check rc $?"; grep -E "vs eager|CHECK|Error" $OUT/graph_check.txt | head -12
echo "== decode9_sweep 48 x 32"; date
wait; tail -1 $OUT/init48.log
timeout $SWEEP python3 tools/device/decode9_sweep.py $M 1 tools/device/$SETTINGS 6 2>&1 | grep -v Warn \
  > $OUT/sweep48.txt; echo "sweep rc $?"
grep -E "^-- |route|idle|attention_split|merge_splits" $OUT/sweep48.txt | head -40
sed -n '/== decode9_sweep/,$p' $OUT/sweep48.txt
date
