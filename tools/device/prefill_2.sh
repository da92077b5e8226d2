# Issue 19, call 2 (one H200): the GPU tests of the tiled experts and the captured towers, the towers'
# warm encode (graph vs eager), fidelity of the defaults, prefill of 48 x 32 A3B layers beside HF.
source tools/device/setup.sh
cp .peer/hf_peer.py /tmp/ 2>/dev/null
python3 -m moebus.cli init-model /tmp/vis --preset a3b --layers 1 --experts 8 --vision siglip > /tmp/initv.log 2>&1 &
VIS=$!
python3 -m moebus.cli init-model /tmp/m48 --preset a3b --layers 48 --experts 32 > /tmp/init48.log 2>&1 &
M48=$!
echo "== GPU tests"; date
MOEBUS_TEST_GPU=1 timeout 90 python3 -m pytest -q -x -p no:cacheprovider tests/cuda/test_gemm.py \
  tests/cuda/test_prefill_tensor_cores.py tests/vision/test_qwen3vl_units.py tests/vision/test_vision_model.py \
  -k "gemm or tensor or tile or expert or captured or cuda_backend" 2>&1 | tail -3
timeout 50 python3 tools/device/tc_fidelity.py /tmp/fid split/split 2>&1 | grep FIDELITY
echo "== towers"; date
wait $VIS
timeout 60 python3 tools/device/tower_encode.py /tmp/vis 2>&1 | grep -v Warn | tail -2
echo "== prefill"; date
wait $M48; tail -1 /tmp/init48.log
timeout 150 python3 -m moebus.cli bench prefill --model /tmp/m48 --device cuda --tokens 512,2048,8192 --peer hf 2>&1 | grep -v Warn | tail -4
date
