#!/usr/bin/env bash
# One GPU (thirty-fourth session, second call; issue 20). gap34.sh measured the cold image under an MPS daemon the
# script started (the vision worker below normal: the encode phase's largest gap 7.1-7.7 ms against 8.5-11.2
# time-sliced, H100). Now `mps: true` starts the service's own private daemon (broker/mps.py). One call (~5 min):
#   1. tests/cuda/test_mps_daemon.py (the daemon starts and answers, a client given its pipes gets a server, stop
#      ends it; the priority variable without a server is harmless);
#   2. gap17.sh's warm phase, then the cycle (8 x 128 A3B LLaVA so400m at --gpu-memory-mib 8192, 2 text streams, cold
#      start 2 of 2) over mpsd (MOEBUS_MPS=true: the setting, vision below normal by default), def, mpsd2.
#   bash tools/device/gap35.sh 2>&1 | tail -40      (carry .whl)
source tools/device/setup.sh
FINAL=$OUT; export OUT=/tmp/g35; rm -rf $OUT; mkdir -p $OUT
L=MOEBUS_LOG_STEPS=1,MOEBUS_LOG_GC_MS=2
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
MOEBUS_TEST_GPU=1 timeout 90 python3 -m pytest -q -p no:cacheprovider -rf tests/cuda/test_mps_daemon.py 2>&1 | tail -4
PHASE=warm BUDGET=${WARM_S:-118} bash tools/device/gap17.sh | tail -2
echo "== warm done at ${SECONDS} s"
VIS_RUNS=${VIS_RUNS:-"mpsd:$L,MOEBUS_MPS=true def:$L mpsd2:$L,MOEBUS_MPS=true"} PHASE=measure BUDGET=${MEASURE_S:-125} \
  bash tools/device/vis17.sh > $OUT/vis.txt 2>&1
for f in $OUT/cycle_budget256_*.log.gz; do
  tag=$(basename $f .log.gz); tag=${tag#cycle_budget256_}; cp $f $FINAL/
  head -2 $OUT/summary_$tag.txt 2>/dev/null | cut -c1-260
  echo "$tag: $(zcat $f | grep -E "^text streams' largest gap" | grep -oE '(encode) / their (median over the cycle|largest without an image) \(worst stream\): [0-9.]+' \
    | sed -E 's/ \(worst stream\)//' | tr '\n' ';') $(zcat $f | grep -E "an image-free window before it" | grep -oE "max [0-9.]+")"
  echo "$tag: $(zcat $f | grep -oE "MPS control daemon (started|stopped)[^:]*" | sort | uniq -c | tr -s ' ' | tr '\n' ';')"
  zcat $f | grep -E "Traceback|ERROR|CUDA_ERROR" | grep -v NOT_READY | head -3 | cut -c1-200
done
grep -E "^=== |^rc=" $OUT/gap12.txt 2>/dev/null | tail -6 | cut -c1-160
echo "== gap35 done at ${SECONDS} s"
