# (As it ran: its settings name fused.WARM_L2 and routing.ROUTER_IN_FLIGHT, taken out after it; decode7_2.sh runs on this tree.)
# Issue 15 item 1, seventh session (branch decode7), first call (~190 s on one H200): the GPU tests of
# the kernels this branch changed (norm_route's in-flight router, the L2 warming, evict-first expert
# loads), the per-kernel profile of a 4 x 32 model's replayed graph (batch 1 and 8), then
# decode7_bench.py on 48 x 32 (batch 1, 8) over the settings of decode7_1.json: the tree before this
# branch's kernels, each change added in turn, then the work-shape variants on top.
# (It measured code since taken out: the L2 warming of commit fae2c82 and its fused.WARM_L2 setting;
# as it stands it no longer runs. decode7_2.sh measures the tree that stayed.)
source tools/device/setup.sh
export MOEBUS_TEST_GPU=1
M=/tmp/m48
timeout 150 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $OUT/init48.log 2>&1 &
timeout 60 python3 -m moebus.cli init-model /tmp/m4 --preset a3b --layers 4 --experts 32 2>&1 | tail -1
echo "== GPU tests"; date
timeout 70 python3 -m pytest -q -x -p no:cacheprovider tests/cuda/test_routing.py tests/cuda/test_fused.py \
  tests/cuda/test_moe.py 2>&1 | tee $OUT/tests.txt | tail -2
echo "== profile (4 x 32)"; date
timeout 45 python3 tools/device/decode_profile.py /tmp/m4 1 8 2>&1 | grep -v Warn | tee $OUT/profile.txt | head -50
echo "== decode7_bench 48 x 32"; date
wait; tail -1 $OUT/init48.log
timeout 150 python3 tools/device/decode7_bench.py $M 1,8 tools/device/decode7_1.json 2>&1 | grep -v Warn \
  | tee $OUT/bench48.txt | tail -9
date
