# Issue 15 item 1, seventh session (branch decode7), second call (~100 s on one H200): the GPU tests
# of routing and attention beside graph == eager (4 x 32), the per-kernel profile at batch 1 and 8,
# the host work of a step (decode7_host.py, cpu backend), then decode7_bench.py on 48 x 32 over
# decode7_2.json: this branch with the settings before it, its defaults, its defaults without the
# evict-first expert loads. (The attention's merge inside its split kernel, in all three, was reverted after
# this call: slower, docs/performance.md.)
source tools/device/setup.sh
export MOEBUS_TEST_GPU=1
M=/tmp/m48
timeout 100 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $OUT/init48.log 2>&1 &
timeout 30 python3 -m moebus.cli init-model /tmp/m4 --preset a3b --layers 4 --experts 32 2>&1 | tail -1
timeout 30 python3 -m moebus.cli init-model /tmp/t48 --preset tiny --layers 48 --experts 32 2>&1 | tail -1
echo "== GPU tests, graph == eager (4 x 32)"; date
timeout 60 python3 tools/device/graph_check.py /tmp/m4 > $OUT/graph_check.txt 2>&1 & GC=$!
timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/cuda/test_routing.py tests/cuda/test_attention.py \
  2>&1 | tee $OUT/tests.txt | tail -1
wait $GC; grep -E "vs eager|CHECK|Error|same" $OUT/graph_check.txt | head -12
echo "== profile (4 x 32)"; date
timeout 40 python3 tools/device/decode_profile.py /tmp/m4 1 8 2>&1 | grep -v Warn | tee $OUT/profile.txt \
  | grep -E "^==|routing|attention|linear|moe_ffn|fused"
echo "== host work"; timeout 20 python3 tools/device/decode7_host.py /tmp/t48 1 8 2>&1 | grep batch
echo "== decode7_bench 48 x 32"; date
wait; tail -1 $OUT/init48.log
timeout 100 python3 tools/device/decode7_bench.py $M 1,8 tools/device/decode7_2.json 2>&1 | grep -v Warn \
  | tee $OUT/bench48.txt | tail -4
date
