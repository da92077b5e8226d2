#!/usr/bin/env bash
# One H200 (twenty-seventh session's plan; issue 20). The token embedding in mapped host memory
# (cuda/memory/host_table.py) gives its VRAM to the expert cache: A3B's 593.5 MiB, ~65 slots at every
# phase of the cold image cycle (541 during the image in the twenty-sixth session). Two calls:
#   PART=cycle (~6 min): gap25.sh's cycle (ROUTE=0, CTX=1: ctx26.py's (now ctx31.py's) context limits first) over runs `vram`
#     (MOEBUS_EMBEDDING_VRAM=1: as before), `host`, `host2` (the default) and `stack` (MOEBUS_CUDA_STACK_BYTES=64 in
#     every worker: cuda/memory/context_limits.py): slots through the image, the largest gaps against the cycle's
#     median (target <= 2x), the step pool beyond its loans (the pow2 loan, twenty-sixth session, first measured here);
#   PART=check (~5 min): the GPU tests of the gather (a mapped table, rows wider than a block's loads in flight), of
#     the stack limit, test_prefetch_stage.py (cuBLAS on a GPU now, not HostBlas: the segfault since the
#     twenty-second session) and test_e2e.py (logits against the cpu device through the mapped table); bench
#     kernels' `embedding` against `embedding host`; then the steady decode all resident (in process) with the
#     table in VRAM and in host memory alternating: what a decode row's PCIe read costs a step.
#   PART=cycle bash tools/device/emb27.sh 2>&1 | tail -40      (carry .whl)
# Twenty-eighth session (no GPU lent either): the freq policy's decay went from 0.9 to 0.98 (MOEBUS_CACHE_DECAY;
# `bench cache --trace streams --landing ahead` replays the cycle's streams with 15-17% fewer experts over PCIe a
# step, the slowest 10% 25% fewer); opt-in: the hand-back's requests launch the next step beside their unmap
# (MOEBUS_HANDBACK_BESIDE_STEP=1) and LLaVA's encoder layers are streamed through two device slots
# (MOEBUS_VISION_STREAM_LAYERS=1: ~82 more slots while the vision worker lives). Four calls now (~35 s a run):
#   PART=cycle (~6 min, MEASURE_S=165): `before` (the twenty-sixth session's state: the table in VRAM, decay 0.9),
#     `host` (the defaults), `host2`, `d90` (the table in host memory, decay 0.9);
#   PART=cycle2 (~6 min, no ctx26.py (now ctx31.py)): `host3` (the defaults: the reference within the call), `beside` (the VRAM
#     lines end "the next step launched beside"; the hand-back's gaps), `stream` (the vision worker's footprint and
#     the reserve at cold start 2, slots through the image, the encode phase's gaps), `stack`
#     (MOEBUS_CUDA_STACK_BYTES=64), `all` (the three together);
#   PART=check also runs tests/cuda/test_launch_ahead.py (the step beside a reserve: tokens and logprobs against
#     steps one at a time), tests/cuda/test_vmm_arena.py (a shrink waiting for an event) and
#     tests/vision/test_tower_stream.py (the streamed tower's bits, eager and replayed);
#   PART=decay (~5 min): the steady decode at a 25% cache (in process), decay 0.9 and 0.98 alternating, batch 1 and
#     8, on the 8-layer A3B text model: what the decay does where the cache is small and nothing shrinks.
# Twenty-ninth session (a machine lent after two sessions without; ~1,600 s of device time after two refusals): one
# cycle call with the runs that decide defaults, then one check call with the decay's steady decode appended:
#   PART=both (~7 min, MEASURE_S=240): host (the defaults), before, beside, stream, all, host2;
#   PART=check DECAY=1 (~8 min).
source tools/device/setup.sh
FINAL=$OUT
LOGS=MOEBUS_LOG_STEPS=1,MOEBUS_LOG_GC_MS=2
if [ "$PART" = both ] || [ "$PART" = cycle2 ]; then  # both: the twenty-ninth session's call; cycle2: the plan before
  ALL=MOEBUS_HANDBACK_BESIDE_STEP=1,MOEBUS_VISION_STREAM_LAYERS=1,MOEBUS_CUDA_STACK_BYTES=64
  if [ "$PART" = both ]; then
    RUNS="host:$LOGS before:$LOGS,MOEBUS_EMBEDDING_VRAM=1,MOEBUS_CACHE_DECAY=0.9 beside:$LOGS,MOEBUS_HANDBACK_BESIDE_STEP=1 stream:$LOGS,MOEBUS_VISION_STREAM_LAYERS=1 all:$LOGS,$ALL host2:$LOGS"
  else
    RUNS="host3:$LOGS beside:$LOGS,MOEBUS_HANDBACK_BESIDE_STEP=1 stream:$LOGS,MOEBUS_VISION_STREAM_LAYERS=1 stack:$LOGS,MOEBUS_CUDA_STACK_BYTES=64 all:$LOGS,$ALL"
  fi
  [ "$PART" = both ] && measure=240 || measure=200
  OUT=$FINAL ROUTE=0 MEASURE_S=${MEASURE_S:-$measure} VIS_RUNS="$RUNS" bash tools/device/gap25.sh 2>&1 | tail -30
  echo "== emb27 $PART done at ${SECONDS} s"
  exit 0
fi
if [ "$PART" = check ]; then
  MOEBUS_TEST_GPU=1 timeout ${TESTS_S:-260} python3 -m pytest -q -p no:cacheprovider -rf --tb=short -W ignore \
    tests/cuda/test_embedding.py tests/cuda/test_context_limits.py tests/cuda/test_prefetch_stage.py \
    tests/cuda/test_e2e.py tests/cuda/test_launch_ahead.py tests/cuda/test_vmm_arena.py tests/vision/test_tower_stream.py \
    > $FINAL/emb_tests.txt 2>&1
  echo "GPU tests rc=$? at ${SECONDS} s: $(tail -1 $FINAL/emb_tests.txt | cut -c1-120)"
  grep -E "^FAILED|Error|Segmentation" $FINAL/emb_tests.txt | head -6
  timeout 120 python3 -m moebus.cli bench kernels --only embedding 2>&1 | grep -E "^embedding" | cut -c1-120
  echo "== kernels done at ${SECONDS} s"
  M=${M:-/tmp/emb27-a3b-8}  # the 8-layer A3B text model (no tower): ~10 GB, ~40 s to make
  [ -f $M/config.json ] || timeout 150 python3 -m moebus.cli init-model $M --preset a3b --layers 8 > /dev/null 2>&1
  for vram in 1 0 1 0; do
    MOEBUS_EMBEDDING_VRAM=$vram timeout 60 python3 -m moebus.cli bench decode --model $M --device cuda --batch 1,8 \
      --tokens 64 --repeats 2 --no-service 2>&1 | grep -E "^ +[0-9]+ +[0-9.]+ " \
      | awk -v v=$vram '{print "embedding in vram " v ": batch " $1 ", " $2 " tok/s, " $3 " ms a step"}'
  done
  echo "== check done at ${SECONDS} s"
  [ -n "$DECAY" ] || exit 0
  PART=decay
fi
if [ "$PART" = decay ]; then
  M=${M:-/tmp/emb27-a3b-8}
  [ -f $M/config.json ] || timeout 150 python3 -m moebus.cli init-model $M --preset a3b --layers 8 > /dev/null 2>&1
  for decay in 0.9 0.98 0.9 0.98; do
    MOEBUS_CACHE_DECAY=$decay timeout 80 python3 -m moebus.cli bench decode --model $M --device cuda --cache-frac 0.25 \
      --batch 1,8 --tokens 64 --repeats 2 --no-service 2>&1 | grep -E "^ +[0-9]+ +[0-9.]+ " \
      | awk -v d=$decay '{print "decay " d ": batch " $1 ", " $2 " tok/s, " $3 " ms a step, hit rate " $5 ", " $6 " GB/s"}'
  done
  echo "== decay done at ${SECONDS} s"
  exit 0
fi
OUT=$FINAL CTX=1 ROUTE=0 MEASURE_S=${MEASURE_S:-165} \
  VIS_RUNS="before:$LOGS,MOEBUS_EMBEDDING_VRAM=1,MOEBUS_CACHE_DECAY=0.9 host:$LOGS host2:$LOGS d90:$LOGS,MOEBUS_CACHE_DECAY=0.9" \
  bash tools/device/gap25.sh 2>&1 | tail -24
echo "== emb27 cycle done at ${SECONDS} s"
