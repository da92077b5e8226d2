# Issue 15 item 1, sixth session (branch decode6), first of two H200 calls (~100 s): GPU tests of the
# changed kernels (norm_route over E/8 blocks, row_stats + sample_rows, attention splits of >= 32,
# expert runs), the per-kernel profile of the replayed step (4 x 32, batch 1 and 8), then as much of
# the work-shape variants (decode6_variants.py) as the call's time allows.
source tools/device/setup.sh
export MOEBUS_TEST_GPU=1
python3 -m moebus.cli init-model /tmp/m4 --preset a3b --layers 4 --experts 32 2>&1 | tail -1
echo "== GPU tests"; date
timeout 45 python3 -m pytest -q -x -p no:cacheprovider tests/cuda/test_routing.py tests/cuda/test_sampling.py \
  tests/cuda/test_attention.py tests/cuda/test_moe.py 2>&1 | tee $OUT/tests.txt | tail -3
echo "== profile (4 x 32)"; date
timeout 40 python3 tools/device/decode_profile.py /tmp/m4 1 8 2>&1 | grep -v Warn | tee $OUT/profile.txt | head -60
echo "== variants"; date
timeout 30 python3 tools/device/decode6_variants.py $OUT/choices.json 2>&1 | grep -v Warn | tee $OUT/variants.txt
date
