#!/usr/bin/env bash
# One H200, issue 20 (twelfth session, branch gap12): the text streams' largest gap through a cold LLaVA
# image, which the eleventh session left at 8.47x their median (47.2 / 5.6 ms) through the image's prefill,
# in the first steps of each spanning chunk. gap10.sh's cycle (the 8 x 128 A3B LLaVA (so400m) under
# --gpu-memory-mib 8192, 2 text streams, --max-batch 4, cold start 2 of 2, copy budget 256 MiB, the time
# share's default 0.5) with the worker's cuBLAS calls over 2 ms of host time logged (gemm_host.SLOW_CALL_S:
# a kernel's first load) and each chunk's slowest steps by part (spanning_chunk.py), read by gap12.py.
# Run by tools/device/lead12_call.sh:
#   PHASE=warm     the model at /tmp/gap-a3b-8x128-vision (~10 GB) beside the GPU tests of the spanning chunk
#                  and HostTiles, then one cycle (the overlap on: its errors show here) cut at BUDGET that
#                  compiles the kernels into the disk cache (no figure read: other branches run beside it);
#   PHASE=measure  RUNS in turn while BUDGET allows, each "tag:VAR=value,VAR=value" (env for that cycle):
#                  by default the decode rows launched beside the chunk's work (MOEBUS_CHUNK_OVERLAP=1,
#                  chunk_rows.py), then read before it (0), then overlapped at a time share of 0.3; all with
#                  the grouped products warmed at the worker's start (moe_prefill.warm_products;
#                  MOEBUS_WARM_PRODUCT_TILES=0: not).
#   PHASE=measure BUDGET=96 bash tools/device/gap12.sh
source tools/device/setup.sh
set -o pipefail
BUDGET=${BUDGET:-96}
export V=${V:-/tmp/gap-a3b-8x128-vision}
summary() {  # tag: the bench's stream lines and the chunks' steps, slow cuBLAS calls
  local L=$OUT/cycle_budget256_$1.log
  grep -E "^cold image request 2|^  (handback|start|encode|prefill) |^  stream [01]:|largest gaps|median before" $L \
    | cut -c1-330
  timeout 20 python3 tools/device/gap12.py $L | cut -c1-1400
  gzip -f $L
}
if [ "$PHASE" = warm ]; then  # beside: the GPU tests of the spanning chunk (the overlap's among them) and HostTiles
  ( MOEBUS_TEST_GPU=1 timeout 90 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_spanning_chunk.py \
      tests/cuda/test_host_tiles.py > $OUT/gpu_tests.log 2>&1; echo "GPU tests rc=$? at ${SECONDS} s" >> $OUT/gpu_tests.log ) &
  [ -f $V/.gap12-ready ] || { rm -rf $V; timeout $((BUDGET - 30)) python3 -m moebus.cli init-model $V --preset a3b \
    --layers 8 --vision siglip > $OUT/init.log 2>&1 && touch $V/.gap12-ready; }
  echo "model built at ${SECONDS} s: $(du -sh $V 2>/dev/null | cut -f1) ($(tail -1 $OUT/init.log | cut -c1-120))"
  left=$((BUDGET - SECONDS - 12))
  if [ $left -gt 20 ]; then  # compiles (cut wherever the budget ends); overlap on: an error there shows early
    MOEBUS_CHUNK_OVERLAP=1 MOEBUS_MAX_PREFILL_COPY_MIB_BESIDE_DECODE=256 timeout $left python3 -m moebus.cli bench \
      vision-cycle --device cuda \
      --model $V --gpu-memory-mib ${GPU_MIB:-8192} -v --idle-s 1 --repeats 1 --text-streams 2 --cold-starts 2 --max-batch 4 \
      --timeout-s 90 --skip-resident > $OUT/warm_cycle.log 2>&1
    echo "warm cycle rc=$? at ${SECONDS} s"
    grep -hE "kernels: .* compiled|kernels warmed in" $OUT/warm_cycle.log | sed -E 's/^.*(INFO|WARNING) //' | cut -c1-160
    echo "ERROR lines: $(grep -c ERROR $OUT/warm_cycle.log), tracebacks: $(grep -c Traceback $OUT/warm_cycle.log)"
    grep -m1 -A12 Traceback $OUT/warm_cycle.log | cut -c1-200
    grep -E "largest gaps|^  stream 0:" $OUT/warm_cycle.log | cut -c1-250  # (not a figure: other branches ran beside)
    timeout 20 python3 tools/device/gap12.py $OUT/warm_cycle.log | cut -c1-1400
    gzip -f $OUT/warm_cycle.log
  fi
  wait
  grep -E "passed|failed|error|rc=" $OUT/gpu_tests.log | tail -4 | cut -c1-200
  exit 0
fi
[ -f $V/.gap12-ready ] || { echo "no model at $V (the warm phase did not finish it)"; exit 1; }
for run in ${RUNS:-overlap:MOEBUS_CHUNK_OVERLAP=1 default:MOEBUS_CHUNK_OVERLAP=0 share03:MOEBUS_CHUNK_OVERLAP=1,MOEBUS_CHUNK_TIME_SHARE=0.3}; do
  tag=${run%%:*}; vars=${run#*:}; left=$((BUDGET - SECONDS))
  echo "=== $tag ($vars) at ${SECONDS} s, ${left} s left"
  if [ $left -lt 34 ]; then echo "not run: ${left} s left"; continue; fi
  cap=$((left - 2)); [ $cap -gt ${RUN_CAP:-62} ] && cap=${RUN_CAP:-62}  # a run that hangs leaves the next its time
  env ${vars//,/ } SKIP_TESTS=1 TAG=$tag BUDGETS=256 FIRST_CAP=$cap BUDGET=$left bash tools/device/gap10.sh \
    > $OUT/gap10_$tag.txt 2>&1
  grep -E "^rc=" $OUT/gap10_$tag.txt
  summary $tag
done
echo "== gap12 done at ${SECONDS} s"
