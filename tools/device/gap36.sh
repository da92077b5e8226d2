#!/usr/bin/env bash
# One H200 (the next session's plan, written in the thirty-fourth; issue 20). Under MPS (`mps: true`, the vision
# worker below normal) the thirty-fourth measured the encode phase's largest gap within the text's own tail on an
# H100 (6.8-7.7 ms over nine runs against 8.4-11.2 time-sliced); what still exceeds it in some runs is a hand-back
# request's gap (8.2-9.7 ms): 7-8 requests of 64 MiB, each 2.5-3.0 ms on the worker (the next step's launch 1.0-1.2
# of it, out of service 0.5, the 3-4 segments of 18 MiB unmapped in 0.2-0.4), a decode step beside. With slot-sized
# segments a request's cost hardly grows with its MiB, so fewer, larger requests give a high-miss step fewer
# chances to meet one. One call (~6.5 min):
#   1. tests/cuda/test_mps_daemon.py;
#   2. gap17.sh's warm phase, then the cycle (8 x 128 A3B LLaVA so400m at --gpu-memory-mib 8192, 2 text streams,
#      cold start 2 of 2) over mps (MOEBUS_MPS=true), hb128 and hb256 (and vision.handback_step_mib 128 / 256),
#      def (time-sliced, the control), mps2.
#   bash tools/device/gap36.sh 2>&1 | tail -50      (carry .whl)
L=MOEBUS_LOG_STEPS=1,MOEBUS_LOG_GC_MS=2
M=$L,MOEBUS_MPS=true
VIS_RUNS=${VIS_RUNS:-"mps:$M hb128:$M,MOEBUS_VISION__HANDBACK_STEP_MIB=128 hb256:$M,MOEBUS_VISION__HANDBACK_STEP_MIB=256 def:$L mps2:$M"} \
  MEASURE_S=${MEASURE_S:-200} bash tools/device/gap35.sh
