# Issue 15 item 1, sixth session (branch decode6): the call this session's device time did not cover
# (~300 s on one H200). GPU tests of sampling (row_stats + the parallel combine) and routing (the
# spread norm_route), eager == graph on 4 x 32, the work-shape variants (decode6_variants.py, fastest
# values into $OUT/choices.json), then with those values set (decode6_apply.py) the per-kernel profile
# (4 x 32, batch 1 and 8; again with routing.SPREAD_ROUTER on) and bench decode on 48 x 32 (batch 1,
# 8, in-process, all resident) with the defaults and with the choices. Set the code's defaults to
# choices.json only where the bench agrees.
source tools/device/setup.sh
export MOEBUS_TEST_GPU=1
M=/tmp/m48; C=$OUT/choices.json
timeout 150 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $OUT/init48.log 2>&1 &
python3 -m moebus.cli init-model /tmp/m4 --preset a3b --layers 4 --experts 32 2>&1 | tail -1
echo "== GPU tests"; date
timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/cuda/test_sampling.py tests/cuda/test_sampling_mask.py \
  tests/cuda/test_routing.py \
  2>&1 | tee $OUT/tests.txt | tail -1
echo "== graph == eager (4 x 32)"; date
timeout 50 python3 tools/device/graph_check.py /tmp/m4 2>&1 | tee $OUT/graph_check.txt | grep -E "vs eager|CHECK|Error"
echo "== variants"; date
timeout 120 python3 tools/device/decode6_variants.py $C 2>&1 | grep -v Warn | tee $OUT/variants.txt
python3 -c "import json, os, sys; c = json.load(open(sys.argv[1])) if os.path.exists(sys.argv[1]) else {}; \
c['routing.SPREAD_ROUTER'] = True; json.dump(c, open(sys.argv[2], 'w'))" $C $OUT/spread.json
for choices in $C $OUT/spread.json; do
  echo "== profile (4 x 32) with $choices"; date
  timeout 40 python3 tools/device/decode6_apply.py $choices tools/device/decode_profile.py /tmp/m4 1 8 2>&1 \
    | grep -v Warn | tee -a $OUT/profile.txt | head -40
done
echo "== bench decode 48 x 32: defaults, then the variants' choices"; date
wait; tail -1 $OUT/init48.log
for choices in none $C; do
  timeout 50 python3 tools/device/decode6_apply.py $choices -m moebus.cli bench decode --model $M --device cuda \
    --batch 1,8 --tokens 64 --repeats 2 --no-service 2>&1 | grep -v Warn | tee -a $OUT/decode48.txt | tail -4
done
date
