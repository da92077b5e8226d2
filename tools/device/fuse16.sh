#!/usr/bin/env bash
# Issues 15 and 16, sixteenth session (branch fuse16): the decode layer's small kernels at batch 1 (norm_route,
# combine_add_rmsnorm, qkv_rope_store) and the launch gaps, in the lead's shared call (lead12_call.sh, S=16).
# PHASE=warm (side by side, nothing timed, BUDGET ~120 s): a 1-layer a3b model (32 experts, /tmp/fuse-m1, ~1.6 GB: the embedding and lm_head),
#   fuse16_step.py QUICK=1 on it over every setting (compiles each variant into /tmp/fuse-nc), and the GPU tests
#   of the kernels this branch owns (test_qkv_gemv.py, test_fused.py, test_routing.py with norm_route, test_pdl.py).
# PHASE=measure (alone, BUDGET ~90 s): fuse16_step.py on $M48 (48 x 32 a3b bf16, all resident, b1) over
#   tools/device/fuse16_settings.json (SETTINGS=... for another file; call A's: fuse16_settings_a.json, with
#   TOKENS=32 REPEATS=2): per setting tok/s, CUPTI us a layer by kernel, busy / gap time a step and the greedy
#   ids + log p against the first setting; the summary last. Call B's settings: the defaults, qkv_gemv and
#   ROUTER_BLOCKS 32 three times in turn (call A's differences were within its drift), then PDL off and twice.
source tools/device/setup.sh
set -o pipefail
PHASE=${PHASE:-measure}; BUDGET=${BUDGET:-90}; OUT=${OUT:-/tmp/fuse16-out}; mkdir -p $OUT; T0=$(date +%s)
source tools/device/steps.sh  # left, at, quiet, step
W=/tmp/fuse-m1; SETTINGS=${SETTINGS:-fuse16_settings.json}
export NUMBA_CACHE_DIR=/tmp/fuse-nc
if [ "$PHASE" = warm ]; then
  [ $BUDGET -gt 120 ] && BUDGET=120
  [ -e $W.ok ] || { timeout 40 python3 -m moebus.cli init-model $W --preset a3b --layers 1 --experts 32 \
    > $OUT/init1.log 2>&1 && touch $W.ok; }
  echo "init 1 layer rc=$? at $(at)"
  ( export NUMBA_CACHE_DIR=/tmp/fuse-nc-tests MOEBUS_TEST_GPU=1  # this branch's new kernels first
    timeout $(( $(left) - 8 )) python3 -m pytest -q -p no:cacheprovider -rf tests/cuda/test_qkv_gemv.py \
      tests/cuda/test_routing.py -k "qkv or router_prefetch" > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? at $(at)" >> $OUT/gpu_tests.txt
    timeout $(( $(left) - 8 )) python3 -m pytest -q -p no:cacheprovider -rf tests/cuda/test_fused.py tests/cuda/test_pdl.py \
      tests/cuda/test_routing.py -k "not router_prefetch" >> $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? at $(at)" >> $OUT/gpu_tests.txt ) &
  SHOW=6 step warm_steps 20 $(( $(left) - 6 )) env QUICK=1 python3 tools/device/fuse16_step.py $W tools/device/$SETTINGS
  wait
  grep -E "passed|failed|rc=" $OUT/gpu_tests.txt | cut -c1-200
  echo "warm done at $(at)"
  exit 0
fi
MODEL=${M48:-/tmp/m48}; [ -d $MODEL ] || { echo "no $MODEL: the 1-layer model"; MODEL=$W; }
export TOKENS=${TOKENS:-64} REPEATS=${REPEATS:-3}  # bench decode's median step of the last of 3 repeats of 64
SHOW=3 step steps 30 $(( $(left) - 5 )) python3 tools/device/fuse16_step.py $MODEL tools/device/$SETTINGS ${STEPS:-4}
echo "gpu tests (warm phase):"; grep -E '^FAILED' $OUT/gpu_tests.txt 2>/dev/null | head -3 | cut -c1-200
grep -E "passed|failed|rc=" $OUT/gpu_tests.txt 2>/dev/null | cut -c1-200
python3 tools/device/fuse16_step.py --summary $OUT/steps.txt
