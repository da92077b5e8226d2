# One H200: host-lean grouped experts and attention; prefill speed (48 x 32) beside HF transformers,
# experts per call vs batched, attention f32 vs split, a 25% cache, GPU time by kernel, so400m encode.
source tools/device/setup.sh
echo "== GPU tests"; date
MOEBUS_TEST_GPU=1 timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/cuda/test_gemm.py 2>&1 | tail -2
python3 -m moebus.cli init-model /tmp/m48 --preset a3b --layers 48 --experts 32 2>&1 | tail -1
echo "== prefill"; date
timeout 200 python3 -m moebus.cli bench prefill --model /tmp/m48 --device cuda --tokens 512,2048,8192 --peer hf 2>&1 | grep -v Warn | tail -4
MOEBUS_EXPERT_CALLS=each timeout 100 python3 -m moebus.cli bench prefill --model /tmp/m48 --device cuda --tokens 2048,8192 --repeats 2 2>&1 | tail -2
MOEBUS_ATTENTION_COMPUTE=f32 timeout 100 python3 -m moebus.cli bench prefill --model /tmp/m48 --device cuda --tokens 2048,8192 --repeats 2 2>&1 | tail -2
timeout 100 python3 -m moebus.cli bench prefill --model /tmp/m48 --device cuda --tokens 2048 --repeats 2 --cache-frac 0.25 2>&1 | tail -1
echo "== kernels"; date
timeout 120 python3 tools/device/kernel_profile.py /tmp/m48 2048 8192 2>&1 | grep -v Warn | tee $OUT/kernel_profile.txt | cut -c1-150 | head -50
echo "== vision"; date
python3 -m moebus.cli init-model /tmp/vis --preset a3b --layers 2 --experts 16 --vision siglip > /dev/null 2>&1
timeout 120 python3 tools/device/vision_encode.py /tmp/vis 2>&1 | grep -v Warn | tail -3
date
