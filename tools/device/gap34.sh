#!/usr/bin/env bash
# One H200 (thirty-fourth session; issue 20). The thirty-third measured the cold image's phases against the text's
# own tail (gap32.sh): the hand-back and the vision start stay within it; the encode exceeds it (9.7 / 10.1 ms in two
# runs of three against 7.4-7.9 without an image): the tower's kernels, in the vision worker's own context, and the
# text's steps are time-sliced. Under an MPS server the two processes' kernels share the SMs instead, and the vision
# worker can ask to be served after the text (MOEBUS_VISION_MPS_PRIORITY=1 -> CUDA_MPS_CLIENT_PRIORITY=1, in the
# zygote's environment only) or on a share of the SMs (MOEBUS_VISION_MPS_THREAD_PERCENT). The twenty-fourth session's
# MPS runs had neither (the encode's largest gap 10.3 against 12.3-13.0 then). One call (~6.5 min):
#   1. the driver, the compute mode, whether nvidia-cuda-mps-control is there;
#   2. gap17.sh's warm phase (the model, a cycle filling the kernel cache);
#   3. the cycle (8 x 128 A3B LLaVA so400m at --gpu-memory-mib 8192, 2 text streams, cold start 2 of 2) without MPS
#      (def), then with a private MPS daemon (its pipe and log directories under /tmp) over mps (equal priority),
#      mpsp (the vision worker below normal), mpsp40 (below normal on 40% of the SMs), mpsp2 (mpsp again); quit after.
# To read: until encoded / cycle and the encode phase's max against the run's own image-free window ("alone").
#   bash tools/device/gap34.sh 2>&1 | tail -50      (carry .whl)
source tools/device/setup.sh
FINAL=$OUT; export OUT=/tmp/g34; rm -rf $OUT; mkdir -p $OUT
L=MOEBUS_LOG_STEPS=1,MOEBUS_LOG_GC_MS=2
echo "driver / compute mode: $(nvidia-smi --query-gpu=driver_version,compute_mode --format=csv,noheader)"
MPS=$(command -v nvidia-cuda-mps-control); echo "MPS control: ${MPS:-none}"
PHASE=warm BUDGET=${WARM_S:-118} bash tools/device/gap17.sh | tail -3
echo "== warm done at ${SECONDS} s"
VIS_RUNS=${DEF_RUNS:-"def:$L"} PHASE=measure BUDGET=${DEF_S:-50} bash tools/device/vis17.sh > $OUT/vis_def.txt 2>&1
echo "== def done at ${SECONDS} s"
# (run as MOEBUS_VISION_MPS_PRIORITY=1 and MOEBUS_VISION_MPS_THREAD_PERCENT=40, priority normal unless set; since
# then settings: vision.mps_priority, below_normal by default on every cuda service, and vision.mps_sm_percent)
N=MOEBUS_VISION__MPS_PRIORITY=normal
MPS_RUNS=${MPS_RUNS:-"mps:$L,$N mpsp:$L mpsp40:$L,MOEBUS_VISION__MPS_SM_PERCENT=40 mpsp2:$L"}
if [ -n "$MPS" ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  $MPS -d; echo "MPS daemon started rc=$? at ${SECONDS} s"
  VIS_RUNS="$MPS_RUNS" PHASE=measure BUDGET=${MPS_S:-175} bash tools/device/vis17.sh > $OUT/vis_mps.txt 2>&1
  echo "server list: $(echo get_server_list | $MPS)"; echo quit | $MPS; sleep 1
  echo "MPS logs: $(tail -4 $CUDA_MPS_LOG_DIRECTORY/control.log 2>/dev/null | tr '\n' ' ' | cut -c1-300)"
  grep -h -iE "error|fail|priorit" $CUDA_MPS_LOG_DIRECTORY/*.log 2>/dev/null | head -6 | cut -c1-200
fi
for f in $OUT/cycle_budget256_*.log.gz; do
  tag=$(basename $f .log.gz); tag=${tag#cycle_budget256_}; cp $f $FINAL/
  head -2 $OUT/summary_$tag.txt 2>/dev/null | cut -c1-260
  echo "$tag: $(zcat $f | grep -E "^text streams' largest gap" | grep -oE '(encode|last token|before it) / their (median (before|over the cycle)|largest without an image) \(worst stream\): [0-9.]+' \
    | sed -E 's/ \(worst stream\)//; s/their median //; s/their largest without an image/alone/' | tr '\n' ';')"
  echo "$tag: $(zcat $f | grep -E "an image-free window before it" | sed -E 's/^ *//' | cut -c1-120 | tr '\n' ' ') \
$(zcat $f | grep -oE "footprint after its first encode: [0-9.]+ MiB" | head -1); slots $(zcat $f | grep -oE 'VRAM [0-9.]+: [0-9]+ expert slots' | tail -2 | tr '\n' ' ')"
  zcat $f | grep -E "Traceback|ERROR|CUDA_ERROR" | grep -v NOT_READY | head -3 | cut -c1-200
done
cat $OUT/summary_*.txt > $FINAL/summaries.txt 2>/dev/null
grep -E "^=== |^rc=|not run" $OUT/gap12.txt 2>/dev/null | tail -8 | cut -c1-200
echo "== gap34 done at ${SECONDS} s"
