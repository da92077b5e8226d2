#!/usr/bin/env bash
# One H200, branch vl11 (issue 18: the Qwen3-VL tower <= 30 ms, a cold image's first token <= 1.0 s). In one
# call (BUDGET seconds of wall, default 230):
#   1. (TESTS=1) beside the model's build (init-model --arch qwen3_vl_moe --preset a3b --layers 4, vlcold10's):
#      the GPU tests of what changed (the patchify kernel, the bytes path == the patches path captured and eager,
#      the capture after the reply, the tower on the tensor cores) into the vision role's kernel cache;
#   2. vl11_encode.py (its timing once init-model is done): the host preprocess, the a3b tower's warm encode
#      with the bytes in and the DeepStack copies early against the patches in and the copies after (A/B in one
#      process; bytes == patches bit for bit, replay == eager), fidelity on cuda (FIDELITY=0: not);
#   3. vlcold10.sh's cycle (TESTS=0 PROBE=0 OLD=0): the four rows and each cold request's phases, the vision
#      worker's start by part (the weights' copy now beside the warm-up) and its encodes by part.
# CYCLE_S: the seconds kept for step 3 (80). SKIP_RESIDENT=1 leaves row (a) out (~40 s less on a fresh
# machine; set by itself when time is short).
source tools/device/setup.sh
set -o pipefail
T0=$(date +%s); BUDGET=${BUDGET:-230}
now() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(now) )); }
Q=/tmp/a3b-qwen3vl-4
( timeout 100 python3 -m moebus.cli init-model $Q --arch qwen3_vl_moe --preset a3b --layers 4 > $OUT/init.log 2>&1;
  echo "init rc=$? at $(now) s" >> $OUT/init.log; touch $OUT/init.done ) &
INIT=$!
VISION_CACHE=$(python3 -c "from moebus.cuda.kernels.kernel_cache import VISION_ROLE, role_cache_dir; print(role_cache_dir(None, VISION_ROLE))")
# (TESTS off by default: the encode below checks bytes == patches and replay == eager in its own process)
if [[ ${TESTS:-0} == 1 ]]; then
  echo "=== GPU tests at $(now) s"
  NUMBA_CACHE_DIR=$VISION_CACHE MOEBUS_TEST_GPU=1 timeout ${TESTS_S:-55} python3 -m pytest -q -p no:cacheprovider \
    tests/cuda/test_patchify.py tests/vision/test_tower_capture_after_reply.py tests/vision/test_qwen3vl_tower_tc.py \
    tests/vision/test_qwen3vl_units.py::test_the_captured_encode_equals_the_eager_one_and_a_new_size_captures_anew \
    tests/vision/test_qwen3vl_units.py::test_an_image_from_its_bytes_encodes_as_from_its_patches \
    > $OUT/gputest.log 2>&1
  echo "gpu tests rc=$? at $(now) s"
  grep -E "passed|failed|FAILED|Error" $OUT/gputest.log | tail -8 | cut -c1-300
fi
echo "=== tower at $(now) s"
ENCODE_S=$(( $(left) - ${CYCLE_S:-80} )); (( ENCODE_S > 75 )) && ENCODE_S=75
WAIT_FOR=$OUT/init.done NUMBA_CACHE_DIR=$VISION_CACHE BUDGET_S=$(( ENCODE_S - 4 )) timeout $ENCODE_S \
  python3 tools/device/vl11_encode.py ${REPEATS:-10} > $OUT/encode.log 2>&1
echo "encode rc=$? at $(now) s"
grep -vE "^\s*$|Loading weights|Writing|it/s\]" $OUT/encode.log | cut -c1-240 | tail -60
wait $INIT; tail -2 $OUT/init.log | cut -c1-200
(( $(left) < 150 )) && SKIP_RESIDENT=${SKIP_RESIDENT:-1}
rm -f $OUT/init.done
echo "=== cold cycle at $(now) s (SKIP_RESIDENT=${SKIP_RESIDENT:-0})"
env TESTS=0 PROBE=0 OLD=0 BUDGET=$(( $(left) - 2 )) ${SKIP_RESIDENT:+SKIP_RESIDENT=$SKIP_RESIDENT} \
  bash tools/device/vlcold10.sh 2>&1 | grep -vE "^numba|^index, name|NVIDIA H200|gpu tests not run|made already"
echo "vl11 end at $(now) s"
