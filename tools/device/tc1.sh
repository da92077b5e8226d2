# One H200: tensor-core kernels on the GPU (cuBLAS), fidelity of long prompts per precision, then
# prefill speed of a 48 x 32 A3B-shaped model beside HF transformers (and at a 25% cache).
source tools/device/setup.sh
python3 -c "import nvmath; print('nvmath', nvmath.__version__)"
echo "== GPU tests"; date
MOEBUS_TEST_GPU=1 timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/cuda/test_gemm.py 2>&1 | tail -4
echo "== fidelity"; date
timeout 150 python3 tools/device/tc_fidelity.py /tmp/fid 2>&1 | grep -v Warn | tee $OUT/fidelity.txt | tail -5
echo "== 48 x 32 prefill"; date
python3 -m moebus.cli init-model /tmp/m48 --preset a3b --layers 48 --experts 32 2>&1 | tail -1
timeout 200 python3 -m moebus.cli bench prefill --model /tmp/m48 --device cuda --tokens 512,2048,8192 --peer hf 2>&1 | grep -v Warn | tail -5
timeout 60 python3 -m moebus.cli bench prefill --model /tmp/m48 --device cuda --tokens 2048 --repeats 2 --cache-frac 0.25 2>&1 | tail -2
date
