#!/usr/bin/env bash
# One H200 (twenty-seventh session's plan; issue 20). The token embedding in mapped host memory
# (cuda/memory/host_table.py) gives its VRAM to the expert cache: A3B's 593.5 MiB, ~65 slots at every
# phase of the cold image cycle (541 during the image in the twenty-sixth session). This call measures
# what that buys and what it costs:
#   1. the GPU tests of the gather (tests/cuda/test_embedding.py: a mapped table, rows wider than a
#      block's loads in flight), the stack limit's, test_prefetch_stage.py's (cuBLAS on a GPU now, not HostBlas: the
#      segfault since the twenty-second session) and bench kernels' embedding against embedding host (T 1..N);
#   2. gap25.sh's cycle (ROUTE=0, CTX=1: ctx26.py's context limits first) with runs `vram`
#      (MOEBUS_EMBEDDING_VRAM=1: as before) and `host`, `host2` (the default): slots through the image,
#      the largest gaps against the cycle's median, the step pool beyond its loans (the pow2 loan,
#      twenty-sixth session, first measured here); and `stack` (MOEBUS_CUDA_STACK_BYTES=64 in every worker:
#      cuda/memory/context_limits.py, the context's local memory at what its kernels need, not 1 KiB a thread);
#   3. DECODE=1: the steady decode all resident (in process), host and VRAM tables alternating: what
#      the PCIe read of a decode row's embedding costs a step (expected a few us of ~4 ms at 8 layers).
#   bash tools/device/emb27.sh 2>&1 | tail -40      (carry .whl; ~7 min: the call's limit is 600 s, MEASURE_S=150 for the four runs)
source tools/device/setup.sh
FINAL=$OUT
MOEBUS_TEST_GPU=1 timeout 120 python3 -m pytest -q -p no:cacheprovider -rf --tb=short -W ignore \
  tests/cuda/test_embedding.py tests/cuda/test_bench_kernels.py tests/cuda/test_context_limits.py \
  tests/cuda/test_prefetch_stage.py > $FINAL/emb_tests.txt 2>&1
echo "GPU tests rc=$? at ${SECONDS} s: $(tail -1 $FINAL/emb_tests.txt | cut -c1-120)"
grep -E "^FAILED|Error" $FINAL/emb_tests.txt | head -6
timeout 120 python3 -m moebus.cli bench kernels --only embedding 2>&1 | grep -E "^embedding" | cut -c1-120
echo "== kernels done at ${SECONDS} s"
LOGS=MOEBUS_LOG_STEPS=1,MOEBUS_LOG_GC_MS=2
OUT=$FINAL CTX=1 ROUTE=0 MEASURE_S=${MEASURE_S:-150} \
  VIS_RUNS="vram:$LOGS,MOEBUS_EMBEDDING_VRAM=1 host:$LOGS host2:$LOGS stack:$LOGS,MOEBUS_CUDA_STACK_BYTES=64" bash tools/device/gap25.sh 2>&1 | tail -24
if [ -n "$DECODE" ]; then
  for vram in 1 0 1 0; do
    MOEBUS_EMBEDDING_VRAM=$vram timeout 60 python3 -m moebus.cli bench decode --model /tmp/gap-a3b-8x128-vision \
      --device cuda --batch 1,8 --tokens 64 --repeats 2 --no-service 2>&1 | grep -E "^ +[0-9]+ +[0-9.]+ " \
      | awk -v v=$vram '{print "embedding in vram " v ": batch " $1 ", " $2 " tok/s, " $3 " ms a step"}'
  done
fi
echo "== emb27 done at ${SECONDS} s"
