# One H200: batched expert products and split-bf16 attention: GPU tests, fidelity per precision,
# prefill speed (48 x 32) beside HF transformers, attention f32 vs split, a 25% cache, host profile.
source tools/device/setup.sh
echo "== GPU tests"; date
MOEBUS_TEST_GPU=1 timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/cuda/test_gemm.py 2>&1 | tail -3
echo "== fidelity"; date
timeout 150 python3 tools/device/tc_fidelity.py /tmp/fid 2>&1 | grep -v Warn | tee $OUT/fidelity.txt | tail -4
echo "== 48 x 32 prefill"; date
python3 -m moebus.cli init-model /tmp/m48 --preset a3b --layers 48 --experts 32 2>&1 | tail -1
timeout 200 python3 -m moebus.cli bench prefill --model /tmp/m48 --device cuda --tokens 512,2048,8192 --peer hf 2>&1 | grep -v Warn | tail -4
MOEBUS_ATTENTION_COMPUTE=f32 timeout 100 python3 -m moebus.cli bench prefill --model /tmp/m48 --device cuda --tokens 2048,8192 --repeats 2 2>&1 | tail -3
timeout 100 python3 -m moebus.cli bench prefill --model /tmp/m48 --device cuda --tokens 2048 --repeats 2 --cache-frac 0.25 2>&1 | tail -2
timeout 100 python3 tools/device/prefill_profile.py /tmp/m48 2048 2>&1 | grep -v Warn | tee $OUT/profile.txt | head -40
date
