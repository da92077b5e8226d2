# Issue 15 items 1-2, call 3 (one H200; NOT RUN yet: the session's device time ran out). GPU tests of
# the kernels changed since decode_2.sh, eager == graph and 25% cache == resident on 4 x 32, bench
# decode on 48 x 32 all resident; args: `profile` (per-kernel times), `cache` (the 25% cache bench),
# `variants` (decode_variants.py: the work shapes that sit behind constants, to pick the defaults).
# Usage: bash tools/device/decode_3.sh [profile|-] [cache|-] [variants|-]
source tools/device/setup.sh
export MOEBUS_TEST_GPU=1
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/cuda/test_linear.py tests/cuda/test_routing.py \
  tests/cuda/test_rmsnorm.py tests/cuda/test_moe.py tests/cuda/test_fused.py 2>&1 | tee $OUT/tests.txt | tail -2
python3 -m moebus.cli init-model /tmp/m4 --preset a3b --layers 4 --experts 32 2>&1 | tail -1
timeout 80 python3 tools/device/graph_check.py /tmp/m4 2>&1 | tee $OUT/graph_check.txt | grep -E "vs eager|CHECK"
[ "$1" = profile ] && timeout 60 python3 tools/device/decode_profile.py /tmp/m4 1 8 2>&1 | grep -v Warn | tee $OUT/profile.txt
rm -rf /tmp/m4; [ -f /tmp/m48/config.json ] || python3 -m moebus.cli init-model /tmp/m48 --preset a3b --layers 48 --experts 32 2>&1 | tail -1
timeout 60 python3 -m moebus.cli bench decode --model /tmp/m48 --device cuda --batch 1,8 --tokens 64 --repeats 2 \
  --no-service 2>&1 | tee $OUT/decode48.txt | grep -v Warn | tail -3
[ "$2" = cache ] && timeout 60 python3 -m moebus.cli bench decode --model /tmp/m48 --device cuda --batch 1,8 --tokens 64 \
  --repeats 2 --no-service --cache-frac 0.25 2>&1 | tee $OUT/decode48_c25.txt | grep -v Warn | tail -3
[ "$3" = variants ] && timeout 90 python3 tools/device/decode_variants.py 2>&1 | grep -v Warn | tee $OUT/variants.txt
date
