# Issue 19, call 1 (one H200): GPU tests of the tiled experts planned on the device, then where the
# time goes: a 2048-token prefill on 12 A3B layers x 32 experts, the so400m and Qwen3-VL towers.
source tools/device/setup.sh
(python3 -m moebus.cli init-model /tmp/m12 --preset a3b --layers 12 --experts 32 > /tmp/init12.log 2>&1;
 python3 -m moebus.cli init-model /tmp/vis --preset a3b --layers 1 --experts 8 --vision siglip > /tmp/initv.log 2>&1) &
echo "== GPU tests"; date
MOEBUS_TEST_GPU=1 timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/cuda/test_gemm.py \
  tests/cuda/test_prefill_tensor_cores.py 2>&1 | tail -3
wait; tail -1 /tmp/init12.log /tmp/initv.log
echo "== prefill"; date
timeout 60 python3 -m moebus.cli bench prefill --model /tmp/m12 --device cuda --tokens 512,2048,8192 2>&1 | grep -v Warn | tail -4
MOEBUS_EXPERT_TILE=128 timeout 40 python3 -m moebus.cli bench prefill --model /tmp/m12 --device cuda --tokens 2048,8192 --repeats 2 2>&1 | tail -2
timeout 60 python3 tools/device/where_time_goes.py prefill /tmp/m12 2048 2>&1 | grep -v Warn | tee $OUT/prefill2048.txt | cut -c1-150 | head -60
echo "== towers"; date
timeout 60 python3 tools/device/where_time_goes.py so400m /tmp/vis 2>&1 | grep -v Warn | tee $OUT/so400m.txt | cut -c1-150 | head -50
timeout 60 python3 tools/device/where_time_goes.py qwen3vl 2>&1 | grep -v Warn | tee $OUT/qwen3vl.txt | cut -c1-150 | head -50
date
