# Issue 15 item 1, eleventh session (branch decode11): one call (BUDGET seconds of command).
# GPU tests of the attention whose last split block merges (bit for bit against merge_splits apart),
# the routing (is_last_block now is_last_of's counter 0) and the fused kernels (loads moved first);
# graph == eager (4 x 32, batch 1 and 8, graph and launched ahead), then decode10_sweep.py on 48 x 32
# with tools/device/decode11.json:
# bench decode's in-process tok/s at batch 1 and 8 (64 tokens, 2 repeats, launch-ahead) and a CUPTI
# profile of 4 replayed steps a batch for: the default (merge in the split kernel), merge apart, the
# tensor-core path's row kernels (grouped_moe gather/swiglu/sum, gemm.split_rows) with 512 / 1024
# threads a block, the planner with 256 threads, the ranks tail off, every numba kernel's carveout at
# max shared, and the batch-8 timeline around the down projection's cuBLAS GEMM (the 5 us idle before
# it). Full tables in $OUT/profiles.txt, stdout in $OUT/sweep.txt. PLAN=tools/device/decode11_2.json: the
# defaults committed after that call (one_token_tail for one token; row kernels of 512 threads; the
# planner of 256) against the settings they replaced, for the merged tree. The tests' summary is
# printed again at the end (the first run lost it past the tool's 12,000 characters).
source tools/device/setup.sh
export MOEBUS_TEST_GPU=1
BUDGET=${BUDGET:-265}; T0=$(date +%s); PLAN=${PLAN:-tools/device/decode11.json}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
M=/tmp/decode11_m48
if [ -f $M/.complete ]; then echo "model $M already there"; else
  (timeout 100 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $OUT/init48.log 2>&1 \
     && touch $M/.complete) & fi
[ -f /tmp/decode11_m4/.complete ] || { timeout 30 python3 -m moebus.cli init-model /tmp/decode11_m4 --preset a3b \
  --layers 4 --experts 32 2>&1 | tail -1 && touch /tmp/decode11_m4/.complete; }
echo "== GPU tests, graph == eager (4 x 32) at $(( $(date +%s) - T0 )) s"
timeout 110 python3 tools/device/graph_check.py /tmp/decode11_m4 --no-cache > $OUT/graph_check.txt 2>&1 & GC=$!
timeout 110 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_attention.py tests/cuda/test_routing.py \
  tests/cuda/test_fused.py -k "merge or real_head or long_context or norm_route or rmsnorm or qkv" 2>&1 | tail -4 \
  | tee $OUT/gpu_tests.txt
wait $GC; echo "graph_check rc $?"; grep -E "vs eager|CHECK|Error" $OUT/graph_check.txt | head -8
wait; tail -1 $OUT/init48.log 2>/dev/null
echo "== decode10_sweep 48 x 32 at $(( $(date +%s) - T0 )) s"
timeout $(( $(left) - 3 )) python3 tools/device/decode10_sweep.py $M $PLAN 4 $OUT/profiles.txt \
  2>&1 | grep -v Warn | tee $OUT/sweep.txt
echo "sweep rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 )) s"
echo "== GPU tests (again)"; cat $OUT/gpu_tests.txt; grep -E "CHECK" $OUT/graph_check.txt
