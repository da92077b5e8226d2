#!/usr/bin/env bash
# One H200, issue 20 (twenty-fourth session, call C): the cold LLaVA cycle with the vision worker and the text
# worker under NVIDIA's Multi-Process Service (MPS: one GPU context server, the two processes' kernels run side by
# side instead of time-sliced). Calls A and B: the tower's slices (captured by slice or eager) did not lower the
# encode phase's largest gap; every phase's largest gap stays 2.2-3x the median before the image.
#   the GPU tests in TESTS; whether nvidia-cuda-mps-control is there; gap17.sh's warm phase (the model, a cycle
#   filling the kernel cache); vis17.sh's measure without MPS (off), then with an MPS daemon started here for
#   the runs in MPS_RUNS (mps: the defaults at 8 GiB; mpswide: at 10.5 GiB), the daemon quit after.
# Only the logs and summaries worth reading go to $OUT (the device tool fetches 8 files).
#   TESTS=... WARM_S=118 MEASURE_S=70 MPS_S=100 bash tools/device/vis24_mps.sh
source tools/device/setup.sh
FINAL=$OUT; export OUT=/tmp/vis24c; rm -rf $OUT; mkdir -p $OUT
LOGS=MOEBUS_LOG_STEPS=1,MOEBUS_LOG_GC_MS=2
if [ -n "$TESTS" ]; then
  MOEBUS_TEST_GPU=1 timeout ${TESTS_S:-60} python3 -m pytest -q -p no:cacheprovider -rf --tb=short -W ignore $TESTS \
    > $FINAL/gpu_tests.log 2>&1
  echo "GPU tests rc=$? at ${SECONDS} s: $(tail -1 $FINAL/gpu_tests.log | cut -c1-150)"
fi
MPS=$(command -v nvidia-cuda-mps-control); echo "MPS control: ${MPS:-none} ($(ls /usr/bin | grep -c mps) mps binaries in /usr/bin)"
PHASE=warm BUDGET=${WARM_S:-118} bash tools/device/gap17.sh | tail -6
echo "== warm done at ${SECONDS} s"
VIS_RUNS="off:$LOGS" PHASE=measure BUDGET=${MEASURE_S:-70} bash tools/device/vis17.sh | tail -4
if [ -n "$MPS" ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  $MPS -d; echo "MPS daemon started rc=$? at ${SECONDS} s"
  VIS_RUNS="mps:$LOGS mpswide:$LOGS,GPU_MIB=10752" PHASE=measure BUDGET=${MPS_S:-100} bash tools/device/vis17.sh | tail -8
  echo quit | $MPS; sleep 1
  echo "MPS log: $(tail -3 $CUDA_MPS_LOG_DIRECTORY/control.log 2>/dev/null | tr '\n' ' ' | cut -c1-300)"
  grep -h -iE "error|fail" $CUDA_MPS_LOG_DIRECTORY/*.log 2>/dev/null | head -5 | cut -c1-200
fi
for tag in off mps mpswide; do
  [ -f $OUT/cycle_budget256_$tag.log.gz ] && cp $OUT/cycle_budget256_$tag.log.gz $FINAL/
  cat $OUT/summary_$tag.txt 2>/dev/null
done > $FINAL/summaries.txt
for tag in mps mpswide; do
  L=$OUT/cycle_budget256_$tag.log.gz; [ -f $L ] || continue
  echo "$tag: $(zcat $L | grep -E "encode [0-9]+:" | tail -1 | sed -E 's/^.*(encode)/\1/' | cut -c1-200)"
  zcat $L | grep -E "Traceback|ERROR" | head -3 | cut -c1-200
done
