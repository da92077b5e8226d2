#!/usr/bin/env bash
# Issues 15 and 16, seventeenth session (branch route17): norm_route's chain at batch 1, in the lead's shared call
# (lead12_call.sh, S=17). The switches (all off, all keep the bits): norm_route.ROUTER_EARLY (round 0's router words
# and the norm's weights before the PDL wait), WARP_TAIL (a spread step of one token ended by warp 0 of each block:
# routing.warp_tail, fence.acq_rel instead of threadfence, no block barrier after the logits), SUMS_UNROLLED.
# PHASE=warm (side by side, nothing timed, BUDGET ~110 s): a 1-layer a3b model (32 experts, /tmp/route-m1), the GPU
#   tests of norm_route (test_routing.py: early_loads' 32-expert case first, every switch against the defaults bit
#   for bit on the GPU; then the other norm_route tests) and test_pdl.py, and fuse16_step.py QUICK=1 over route17_settings.json (compiles every variant, /tmp/route-nc).
# PHASE=measure (alone, BUDGET ~90 s): fuse16_step.py on $M48 (48 x 32 a3b bf16, all resident, b1, TOKENS=32
#   REPEATS=2) over tools/device/route17_settings.json: tok/s with PDL on (defaults, early, all, all over 32
#   blocks, one block a token with early loads) and CUPTI true durations with MOEBUS_PDL=0 (pdl_off = the
#   defaults, then the switches), greedy ids + log p against the defaults ("bits"); the summary last.
source tools/device/setup.sh
set -o pipefail
PHASE=${PHASE:-measure}; BUDGET=${BUDGET:-90}; OUT=${OUT:-/tmp/route17-out}; mkdir -p $OUT; T0=$(date +%s)
source tools/device/steps.sh  # left, at, quiet, step
W=/tmp/route-m1; SETTINGS=${SETTINGS:-route17_settings.json}
export NUMBA_CACHE_DIR=/tmp/route-nc
if [ "$PHASE" = warm ]; then
  [ $BUDGET -gt 120 ] && BUDGET=120
  ( export NUMBA_CACHE_DIR=/tmp/route-nc-tests MOEBUS_TEST_GPU=1  # this branch's switches first
    timeout $(( $(left) - 8 )) python3 -m pytest -q -p no:cacheprovider -rf tests/cuda/test_routing.py \
      -k "early_loads and 32-8-40" > $OUT/gpu_tests.txt 2>&1
    echo "gpu tests rc=$? at $(at)" >> $OUT/gpu_tests.txt
    timeout $(( $(left) - 8 )) python3 -m pytest -q -p no:cacheprovider -rf tests/cuda/test_routing.py \
      tests/cuda/test_pdl.py -k "norm_route and not early_loads or pdl or early_loads and 37-3" >> $OUT/gpu_tests.txt 2>&1
    echo "gpu tests rc=$? at $(at)" >> $OUT/gpu_tests.txt ) &  # the tests need no model: beside its init
  [ -e $W.ok ] || { timeout 40 python3 -m moebus.cli init-model $W --preset a3b --layers 1 --experts 32 \
    > $OUT/init1.log 2>&1 && touch $W.ok; }
  echo "init 1 layer rc=$? at $(at)"
  SHOW=6 step warm_steps 20 $(( $(left) - 6 )) env QUICK=1 python3 tools/device/fuse16_step.py $W tools/device/$SETTINGS
  wait
  grep -E "^FAILED|passed|failed|rc=" $OUT/gpu_tests.txt | head -8 | cut -c1-200
  echo "warm done at $(at)"
  exit 0
fi
MODEL=${M48:-/tmp/m48}; [ -d $MODEL ] || { echo "no $MODEL: the 1-layer model"; MODEL=$W; }
export TOKENS=${TOKENS:-32} REPEATS=${REPEATS:-2}  # call A's fuse16 figures were taken so
echo "gpu tests (warm phase):"; grep -E '^FAILED' $OUT/gpu_tests.txt 2>/dev/null | head -3 | cut -c1-200
grep -E "passed|failed|rc=" $OUT/gpu_tests.txt 2>/dev/null | cut -c1-200
SHOW=2 step steps 30 $(( $(left) - 4 )) python3 tools/device/fuse16_step.py $MODEL tools/device/$SETTINGS ${STEPS:-4}
python3 tools/device/fuse16_step.py --summary $OUT/steps.txt > $OUT/summary.txt  # every kernel's line (TOP 12)
TOP=4 python3 tools/device/fuse16_step.py --summary $OUT/steps.txt \
  | sed -E 's/ cb +[0-9.]+ qkv +[0-9.]+ qg +[0-9.]+//'  # "nr": norm_route us a layer (true durations where PDL off)
