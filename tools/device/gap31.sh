#!/usr/bin/env bash
# One H200 (the thirty-first session's plan, written in the thirtieth; issue 20). The thirtieth measured the text's
# own tail (gap30.sh: the same streams without an image reach 1.97-2.15x the cycle's median, 2.38-2.46x through the
# cold image until encoded); of the image's ~1-1.5 ms the hand-back's six 64 MiB requests are the largest part: each
# 4.3-5.6 ms on the worker (30-32 segments of 2 MiB unmapped in 1.3-2.7 ms with the next step beside, ~1 ms idle in
# 2-MiB-segment timings; 0.6 ms of handle releases; ~2 ms more, now named in the VRAM line), the step after it ~5 ms
# late. One call (~8.5 min):
#   1. tools/device/unmap30.py: a 64 MiB shrink idle, beside a ~2 ms kernel, and on a helper thread while the main
#      thread launches kernels (does cuMemUnmap wait for running kernels? hold the launches?), 2 and 18 MiB segments;
#   2. the streamed tower's GPU tests (tests/vision/test_tower_stream.py: MOEBUS_VISION_STREAM_HOST=register reads
#      the zygote's packed layers registered read-only, bit for bit);
#   3. gap30.sh's cycle over def, seg18 (MOEBUS_SEGMENT_MIB=18: two 9 MiB slots a segment, 4 segments a request),
#      reg (MOEBUS_VISION_STREAM_HOST=register: no 803 MiB pinned buffer allocated and filled at the vision
#      worker's start, twenty-ninth session's +0.35-0.45 s), one18 (18 MiB segments, the hand-back in one request:
#      --handback-step-mib=600), then def2, slot and m16 (thirty-first session; they replace the second seg18 and reg):
#      `slot` (MOEBUS_SEGMENT_MIB=0, thirty-first session: two slots a segment, 18 MiB here);
#      `m16` (MOEBUS_VISION_RESERVE_MARGIN_MIB=16: the reserve 5% above the measured footprint,
#      not 64 MiB: ~4 more slots through the image; the cpu replay says the slots are most of the image's share).
#   4. (added in the thirty-first session, which had no device) each run's vision footprints: the start's, and the
#      lazy start's first encode's (its ENCODE_REPLY's measured_bytes, where VISION_READY reckoned 128 MiB of scratch),
#      the reserves they give; the first start's reserve is now reckoned with a 284 MiB context at the 64 B stack
#      limit (544 MiB where it said 780); tests/cuda/test_vision_footprint.py runs the NVML reading itself.
#      tools/device/ctx31.py: what a fresh context's limits hold (printf FIFO, malloc heap, device runtime), the SMs.
#   bash tools/device/gap31.sh 2>&1 | tail -60      (carry .whl)
source tools/device/setup.sh
[ "${UNMAP:-1}" = 0 ] || timeout 90 python3 tools/device/unmap30.py 2>&1 | tail -8  # UNMAP=0: skipped (short calls)
timeout 60 python3 tools/device/ctx31.py 2>&1 | tail -9
MOEBUS_TEST_GPU=1 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/vision/test_tower_stream.py \
  tests/cuda/test_vision_footprint.py 2>&1 | tail -3
L=MOEBUS_LOG_STEPS=1,MOEBUS_LOG_GC_MS=2
VIS_RUNS=${VIS_RUNS:-"def:$L seg18:$L,MOEBUS_SEGMENT_MIB=18 reg:$L,MOEBUS_VISION_STREAM_HOST=register one18:$L,MOEBUS_SEGMENT_MIB=18,CYCLE_ARGS=--handback-step-mib=600 def2:$L slot:$L,MOEBUS_SEGMENT_MIB=0 m16:$L,MOEBUS_VISION_RESERVE_MARGIN_MIB=16"} \
  MEASURE_S=${MEASURE_S:-280} bash tools/device/gap30.sh 2>&1 | tail -30
for f in $OUT/cycle_budget256_*.log.gz; do  # the streamed tower's host blocks and each cold start's start phase
  echo "$(basename $f): $(zcat $f | grep -oE "the streamed tower's [0-9]+ layers .*" | sort | uniq -c | tr -s ' ' | tr '\n' ';') \
$(zcat $f | grep -oE '^cold image request [0-9] of [0-9]: handback [0-9.]+ ms, start [0-9.]+ ms' | tr '\n' ';')"
done
for f in $OUT/cycle_budget256_*.log.gz; do  # each run's hand-back requests, by part
  echo "$(basename $f): $(zcat $f | grep -oE 'VRAM [0-9.]+: [0-9]+ expert slots, [0-9.]+ ms.*release [0-9.]+' \
    | sed -E 's/waiting for admissions, //' | tail -6 | cut -c1-260 | tr '\n' '|')"
done
for f in $OUT/cycle_budget256_*.log.gz; do  # the footprints and the reserves they gave (the first start's reckoned)
  echo "$(basename $f): $(zcat $f | grep -oE "footprint after its first encode: [0-9.]+ MiB.*|s (start|start and first encode) took [0-9.]+ MiB of gpu0.*frees [0-9.]+ MiB" \
    | cut -c1-200 | tr '\n' ';')"
done
echo "== gap31 done at ${SECONDS} s"
