# Issue 15 items 1-2, call 2 (one H200): GPU tests of the changed kernels; the per-kernel profile of a
# replayed step (4 layers x 32 experts, batch 1 and 8); eager == graph and 25% cache == resident;
# the next-layer router as a predictor; bench decode on 48 x 32 all resident and at a 25% cache.
source tools/device/setup.sh
export MOEBUS_TEST_GPU=1
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/cuda/test_linear.py tests/cuda/test_fused.py \
  tests/cuda/test_moe.py tests/cuda/test_routing.py tests/cuda/test_moe_quant.py tests/cuda/test_backend.py 2>&1 \
  | tee $OUT/tests.txt | tail -3
python3 -m moebus.cli init-model /tmp/m4 --preset a3b --layers 4 --experts 32 2>&1 | tail -1
timeout 90 python3 tools/device/decode_profile.py /tmp/m4 1 8 2>&1 | grep -v Warn | tee $OUT/profile.txt | grep -v "^  "
timeout 80 python3 tools/device/graph_check.py /tmp/m4 2>&1 | tee $OUT/graph_check.txt | grep -E "vs eager|CHECK"
rm -rf /tmp/m4; python3 -m moebus.cli init-model /tmp/m48 --preset a3b --layers 48 --experts 32 2>&1 | tail -1
timeout 60 python3 -m moebus.cli bench decode --model /tmp/m48 --device cuda --batch 1,8 --tokens 64 --repeats 2 \
  --no-service 2>&1 | tee $OUT/decode48.txt | grep -v Warn | tail -3
timeout 60 python3 -m moebus.cli bench decode --model /tmp/m48 --device cuda --batch 1,8 --tokens 64 --repeats 2 \
  --no-service --cache-frac 0.25 2>&1 | tee $OUT/decode48_c25.txt | grep -v Warn | tail -3
timeout 60 python3 tools/device/decode_predict.py /tmp/m48 8 8 2>&1 | grep -v Warn | tee $OUT/predict.txt | tail -4
date
