#!/usr/bin/env bash
# One GPU (thirty-sixth session; issue 20). A decode step whose experts do not all fit takes ~1.1-1.4 ms + ~0.15 ms a
# miss read in place + ~0.23 ms an admission (the thirty-third and thirty-fifth sessions' logs, 742-819 steps a run):
# its time follows its misses, which vary with the routing. Replayed on the cpu (the cycle's own streams trace,
# `moebus bench cache --trace streams --step-model 1.39,0.165,0.22`), the routing alone puts the cold start's largest
# step at 1.6-2.0x the cycle's median at 753 slots (--gpu-memory-mib 8192: the image's 45 slots are +4 misses a step
# there) and at 1.3-1.6x at ~300 slots (4096: a step reads ~4x the experts, their spread a smaller share). One call
# (~6 min): gap17.sh's warm phase, then the cycle (8 x 128 A3B LLaVA so400m, 2 text streams, cold start 2 of 2,
# every step logged) at 4096 MiB with its resident row (full), then --skip-resident at 4096 (n4k), 8192 (def), 4096,
# 4096 (RUNS="tag:MiB[:VAR=v,...] ..."; a tag beginning full reads the resident row); per run the bench's lines,
# gap15_gaps.py's summary and resid41.py (the steps against their misses). IDLE_S: the bench's --idle-s (1); RUN_CAP: a
# run's timeout (70 s; a fresh machine's first `full` run, its vision kernels compiled in the resident phase, needs
# ~100).
#   bash tools/device/gap41.sh 2>&1 | tail -60      (carry .whl)
source tools/device/setup.sh
FINAL=$OUT; export OUT=/tmp/g41; rm -rf $OUT; mkdir -p $OUT
export V=/tmp/gap-a3b-8x128-vision
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PHASE=warm BUDGET=${WARM_S:-118} bash tools/device/gap17.sh | tail -2
echo "== warm done at ${SECONDS} s"
BUDGET=${BUDGET:-330}
for run in ${RUNS:-full:4096 n4k:4096 def:8192 n4k2:4096 n4k3:4096}; do
  tag=${run%%:*}; mib=${run#*:}; vars=; [ "${mib#*:}" != "$mib" ] && { vars=${mib#*:}; mib=${mib%%:*}; }
  left=$((BUDGET - SECONDS)); L=$OUT/cycle_budget256_$tag.log
  [ $left -lt 40 ] && { echo "$tag not run: ${left} s left"; continue; }
  skip=--skip-resident; case $tag in full*) skip= ;; esac
  env ${vars//,/ } MOEBUS_LOG_STEPS=1 MOEBUS_LOG_GC_MS=2 MOEBUS_MAX_PREFILL_COPY_MIB_BESIDE_DECODE=256 \
    timeout $((left < ${RUN_CAP:-70} ? left : ${RUN_CAP:-70})) \
    python3 -m moebus.cli bench vision-cycle --device cuda --model $V \
    --gpu-memory-mib $mib -v --idle-s ${IDLE_S:-1} --repeats 1 --text-streams 2 --cold-starts 2 --max-batch 4 \
    --timeout-s 60 $skip > $L 2>&1
  echo "=== $tag ($mib MiB${vars:+, $vars}) rc=$? at ${SECONDS} s"
  grep -vE "^\{" $L | grep -E "^\(|^  \(|^ *\([a-d]\)|^ +\(read |over the cycle|own share|own tail" | cut -c1-230
  timeout 10 python3 tools/device/gap15_gaps.py $L --summary $tag 2>&1 | head -2 | cut -c1-250
  timeout 10 python3 tools/device/resid41.py $L 2>&1 | cut -c1-250
  grep -E "Traceback|ERROR|CUDA_ERROR" $L | grep -v NOT_READY | head -3 | cut -c1-200
  gzip -f $L; cp $L.gz $FINAL/
done
echo "== gap41 done at ${SECONDS} s"
