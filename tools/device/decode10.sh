# Issue 15 item 1, tenth session (branch decode10): one call (~125 s of command, BUDGET seconds; run at 4910d2e,
# with ROUTER_BLOCKS 8 as the default and the ranks tail for one token only).
# The GPU tests of norm_route (the router's rows over ROUTER_BLOCKS blocks a token, bit for bit
# against one block a token), graph == eager (4 x 32, batch 1 and 8, graph and launched ahead), then
# decode10_sweep.py on 48 x 32: bench decode's in-process tok/s at batch 1 and 8 (64 tokens, 2
# repeats, launch-ahead) with the router over 8 blocks (the default), one block a token (the
# switch off: norm_route.ROUTER_BLOCKS = 1), 16 and 4 blocks, and each setting's CUPTI per-kernel
# profile at batch 1 and 8 (full tables in $OUT/profiles.txt). PLAN=tools/device/decode10_2.json: the
# ranks tail (routing.ranks_tail) on, off (norm_route.ROUTER_RANKS = false) and one block a token
# (the tenth session's second call, never run; decode11.json timed the ranks tail off since).
source tools/device/setup.sh
export MOEBUS_TEST_GPU=1
BUDGET=${BUDGET:-125}; T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
M=/tmp/decode10_m48
if [ -f $M/.complete ]; then echo "model $M already there"; else
  (timeout 100 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $OUT/init48.log 2>&1 \
     && touch $M/.complete) & fi
[ -f /tmp/decode10_m4/.complete ] || { timeout 30 python3 -m moebus.cli init-model /tmp/decode10_m4 --preset a3b \
  --layers 4 --experts 32 2>&1 | tail -1 && touch /tmp/decode10_m4/.complete; }
echo "== GPU tests, graph == eager (4 x 32) at $(( $(date +%s) - T0 )) s"
timeout 70 python3 tools/device/graph_check.py /tmp/decode10_m4 --no-cache > $OUT/graph_check.txt 2>&1 & GC=$!
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_routing.py 2>&1 | tail -3
wait $GC; echo "graph_check rc $?"; grep -E "vs eager|CHECK|Error" $OUT/graph_check.txt | head -8
wait; tail -1 $OUT/init48.log 2>/dev/null
echo "== decode10_sweep 48 x 32 at $(( $(date +%s) - T0 )) s"
timeout $(( $(left) - 3 )) python3 tools/device/decode10_sweep.py $M ${PLAN:-tools/device/decode10.json} 4 $OUT/profiles.txt \
  2>&1 | grep -v Warn
echo "sweep rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 )) s"
