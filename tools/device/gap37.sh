#!/usr/bin/env bash
# One GPU (thirty-fifth session; issue 20). gap36.sh's five cycles on an H100 found the text's own tail, with no image,
# at 6.8-23.7 ms over a ~3 ms median: decode steps that read 108-144 MiB of misses in place took 12-22 ms where their
# like took 3-5. Whose outliers are those? One call (~5 min):
#   1. jitter37.py: mapped reads, copies, a tiny kernel's round trip and the host's clock loop, alone (no moebus);
#      nvidia-smi samples the link's generation, the SM clock and the throttle reasons meanwhile;
#   2. gap17.sh's warm phase, then the cycle with MOEBUS_STEP_STACKS_S=0.006: a step that runs longer than 6 ms
#      logs the worker thread's innermost frames every 6 ms (where the host waits in a slow step).
#   bash tools/device/gap37.sh 2>&1 | tail -50      (carry .whl)
source tools/device/setup.sh
uptime; nproc
nvidia-smi --query-gpu=pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,clocks.sm,clocks.max.sm,\
clocks_throttle_reasons.active,pstate --format=csv -lms 500 > /tmp/smi37.csv 2>&1 &
SMI=$!
python3 tools/device/jitter37.py --mib 108 --reps 2000 2>&1 | tee $OUT/jitter37.txt
python3 tools/device/jitter37.py --mib 9 --reps 4000 --host-s 1 | grep -E "^(mapped|copy)"
kill $SMI; sort /tmp/smi37.csv | uniq -c | sort -rn | head -8
L=MOEBUS_LOG_STEPS=1,MOEBUS_LOG_GC_MS=2
VIS_RUNS=${VIS_RUNS:-"stk:$L,MOEBUS_MPS=true,MOEBUS_STEP_STACKS_S=0.006"} MEASURE_S=${MEASURE_S:-60} \
  bash tools/device/gap35.sh 2>&1 | grep -v "^2 passed\|NAT =\|^-- Docs\|^\s*$"
zcat $OUT/cycle_budget256_stk.log.gz | grep -E "took [0-9.]+ ms \(batch|running for" | cut -c1-330 | head -40
