#!/usr/bin/env bash
# The eleventh session's lead call 2 on the merged tree (integ11 with quant11 and gap11b): what the first
# call left unmeasured. In order, each only while BUDGET (the call's seconds) lasts:
#   1. GPU tests of the session's changes (the merge inside the split kernel, the row kernels at 512
#      threads, the tensor-core chunk attention after the tile kernel's removal, the patchify kernel and the
#      tower's early copies, the spanning chunk bounded by time; graph == eager ran in decode11's call);
#   2. quant11.sh (the quantized decode GEMVs at 24 x 32, per setting, by kernel);
#   3. vl11_encode.py (the Qwen3-VL a3b tower, 1024 x 768: bytes in and early copies against before);
#   4. gap11.sh untraced (the cold LLaVA image's gaps, the chunk steps by part).
# Every part's files go into one tarball a part ($OUT/<part>.tgz: the tool brings back 8 files at most);
# the figures are printed.
set +e
source tools/device/setup.sh > /dev/null
T0=$(date +%s); BUDGET=${BUDGET:-380}; O=/tmp/o
now() { echo $(( $(date +%s) - T0 )); }
upto() { local l=$(( BUDGET - $(now) )); echo $(( l < $1 ? l - 3 : $1 )); }
pack() { tar czf $OUT/$1.tgz -C $O $1 2>/dev/null; }
mkdir -p $O/tests $O/quant $O/vl $O/gap
V=/tmp/a3b-8x128-vision  # gap10.sh's model, built beside the tests (moved into place whole)
(timeout 100 python3 -m moebus.cli init-model /tmp/v_new --preset a3b --layers 8 --vision siglip > $O/gap/init.log 2>&1 \
  && mv /tmp/v_new $V) &
echo "== 1. GPU tests at $(now) s"
MOEBUS_TEST_GPU=1 timeout $(upto ${TESTS_S:-90}) python3 -m pytest -q -rfE -p no:cacheprovider \
  tests/cuda/test_attention.py tests/cuda/test_routing.py tests/cuda/test_attention_chunk_tc.py \
  tests/cuda/test_spanning_chunk.py tests/cuda/test_decode_tensor_cores.py tests/cuda/test_patchify.py \
  tests/vision/test_tower_capture_after_reply.py tests/vision/test_qwen3vl_tower_tc.py \
  tests/cuda/test_fused.py > $O/tests/gpu_tests.txt 2>&1
echo "rc=$? at $(now) s"; grep -aE "^(FAILED|ERROR)|passed|failed" $O/tests/gpu_tests.txt | cut -c1-240 | head -12
pack tests
echo "== 2. quant11 at $(now) s"
(cd $O/quant && true); PLAN=${QUANT_PLAN:-quant11_plan_short.json} WARM_S=45 OUT=$O/quant BUDGET=$(( $(upto ${QUANT_S:-150}) - 6 )) timeout $(upto ${QUANT_S:-150}) \
  bash tools/device/quant11.sh > $O/quant/stdout.txt 2>&1
echo "rc=$? at $(now) s"; tail -c ${QUANT_TAIL:-4000} $O/quant/stdout.txt; pack quant
echo "== 3. the Qwen3-VL tower at $(now) s"
BUDGET_S=$(( $(upto ${VL_S:-55}) - 6 )) timeout $(upto ${VL_S:-55}) python3 tools/device/vl11_encode.py ${REPEATS:-10} \
  > $O/vl/encode.log 2>&1
echo "rc=$? at $(now) s"; grep -vE "^\s*$|Loading weights|Writing|it/s\]" $O/vl/encode.log | cut -c1-220 | tail -30; pack vl
if (( BUDGET - $(now) > ${GAP_MIN_S:-60} )); then
  echo "== 4. the cold LLaVA image, untraced, at $(now) s"
  wait; OUT=$O/gap SKIP_TESTS=1 TRACE_STEPS=0 BUDGET=$(( BUDGET - $(now) - 5 )) timeout $(( BUDGET - $(now) - 2 )) bash tools/device/gap11.sh \
    > $O/gap/stdout.txt 2>&1
  echo "rc=$? at $(now) s"; grep -aE "largest gap|cold image request|a prompt chunk of .* done|prefill  " $O/gap/stdout.txt | cut -c1-400 | head -14
  pack gap
fi
echo "lead11_call2 end at $(now) s"
