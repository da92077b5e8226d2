# One H200, the figures of docs/performance.md (issue 19): GPU tests, fidelity of the defaults,
# prefill of a 48 x 32 A3B-shaped model beside HF transformers, attention f32, a 25% cache, kernels.
source tools/device/setup.sh
echo "== GPU tests"; date
MOEBUS_TEST_GPU=1 timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/cuda/test_gemm.py 2>&1 | tail -1
timeout 60 python3 tools/device/tc_fidelity.py /tmp/fid split/split,split/f32 2>&1 | grep FIDELITY
python3 -m moebus.cli init-model /tmp/m48 --preset a3b --layers 48 --experts 32 2>&1 | tail -1
echo "== prefill"; date
timeout 150 python3 -m moebus.cli bench prefill --model /tmp/m48 --device cuda --tokens 512,2048,8192 --peer hf 2>&1 | grep -v Warn | tail -4
MOEBUS_ATTENTION_COMPUTE=f32 timeout 60 python3 -m moebus.cli bench prefill --model /tmp/m48 --device cuda --tokens 2048,8192 --repeats 2 2>&1 | tail -2
timeout 40 python3 -m moebus.cli bench prefill --model /tmp/m48 --device cuda --tokens 2048 --repeats 2 --cache-frac 0.25 2>&1 | tail -1
timeout 40 python3 tools/device/kernel_profile.py /tmp/m48 2048 2>&1 | grep -v Warn | tee $OUT/kernel_profile.txt | cut -c1-66,140-160 | head -14
date
