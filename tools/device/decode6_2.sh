# Issue 15 item 1, sixth session (branch decode6), second H200 call: eager == graph on 4 x 32, the
# per-kernel profile again, bench decode on 48 x 32 (batch 1, 8, in-process, all resident).
source tools/device/setup.sh
export MOEBUS_TEST_GPU=1
M=/tmp/m48
timeout 120 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $OUT/init48.log 2>&1 &
python3 -m moebus.cli init-model /tmp/m4 --preset a3b --layers 4 --experts 32 2>&1 | tail -1
echo "== graph == eager (4 x 32)"; date
timeout 50 python3 tools/device/graph_check.py /tmp/m4 2>&1 | tee $OUT/graph_check.txt | grep -E "vs eager|CHECK|Error"
echo "== profile (4 x 32)"; date
timeout 40 python3 tools/device/decode_profile.py /tmp/m4 1 8 2>&1 | grep -v Warn | tee $OUT/profile.txt | head -60
echo "== bench decode 48 x 32"; date
wait; tail -1 $OUT/init48.log
timeout 60 python3 -m moebus.cli bench decode --model $M --device cuda --batch 1,8 --tokens 64 --repeats 2 \
  --no-service 2>&1 | grep -v Warn | tee $OUT/decode48.txt | tail -4
date
