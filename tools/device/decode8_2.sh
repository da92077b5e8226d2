# Issue 15 item 1, eighth session (branch decode8), second call (run at f70b86f under `timeout 150`,
# which cut it during its 9th setting): the GPU tests of the GEMVs' work shapes and of L2 warming beside
# graph == eager (4 x 32), then decode8_sweep.py on 48 x 32 over decode8_2.json (batch-1 tok/s,
# per-kernel us, gaps between graph nodes for each setting) with the host probe after the defaults:
# the step's wall time against the captured graph replayed alone, and cProfile's host functions.
# L2 warming (loads.WARM_*, tests/cuda/test_l2_warm.py) was taken out after it (slower,
# docs/performance.md): this script and its settings run only at that commit; decode8_3.sh is the next.
source tools/device/setup.sh
export MOEBUS_TEST_GPU=1
M=/tmp/m48
timeout 100 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $OUT/init48.log 2>&1 &
timeout 30 python3 -m moebus.cli init-model /tmp/m4 --preset a3b --layers 4 --experts 32 2>&1 | tail -1
echo "== GPU tests, graph == eager (4 x 32)"; date
timeout 60 python3 tools/device/graph_check.py /tmp/m4 > $OUT/graph_check.txt 2>&1 & GC=$!
timeout 70 python3 -m pytest -q -x -p no:cacheprovider tests/cuda/test_linear.py tests/cuda/test_moe.py tests/cuda/test_l2_warm.py \
  2>&1 | tee $OUT/tests.txt | tail -1
wait $GC; grep -E "vs eager|CHECK|Error|same" $OUT/graph_check.txt | head -12
echo "== decode8_sweep 48 x 32"; date
wait; tail -1 $OUT/init48.log
timeout 105 python3 tools/device/decode8_sweep.py $M 1 tools/device/decode8_2.json 6 2>&1 | grep -v Warn \
  > $OUT/sweep48.txt; echo "sweep rc $?"
sed -n '/-- host probe/,/^[a-z]/p' $OUT/sweep48.txt | head -24
sed -n '/== decode8_sweep/,$p' $OUT/sweep48.txt
date
