# One H200: kernels on the GPU, the cuda path end to end, the cache at 100% vs 10%, bench vram.
source tools/device/setup.sh
set -o pipefail
echo "== kernel tests on the GPU"; date
MOEBUS_TEST_GPU=1 timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/cuda 2>&1 | tail -15 | tee $OUT/gpu_tests.txt
echo "== bench kernels"; date
timeout 240 python3 -m moebus.cli bench kernels --deadline-s 200 2>&1 | tee $OUT/kernels.txt | tail -40
echo "== generate cuda vs cpu (tiny)"; date
python3 -m moebus.cli init-model /tmp/tiny >/dev/null
for d in cuda cpu; do timeout 180 python3 -m moebus.cli generate --model /tmp/tiny --prompt-tokens 5,17,99,3,42 \
  --max-tokens 32 --device $d --json --local > $OUT/gen_$d.json; done
python3 -c "import json; a=json.load(open('$OUT/gen_cuda.json')); b=json.load(open('$OUT/gen_cpu.json')); import numpy as np; print('tokens equal', a['tokens']==b['tokens'], 'max dlogprob', float(np.abs(np.array(a['logprobs'])-np.array(b['logprobs'])).max()))"
echo "== generate through broker + worker on cuda"; date
timeout 180 python3 -m moebus.cli generate --model /tmp/tiny --prompt-tokens 5,17,99,3,42 --max-tokens 32 --device cuda --json > $OUT/gen_service.json 2>$OUT/gen_service.err
python3 -c "import json; a=json.load(open('$OUT/gen_service.json')); b=json.load(open('$OUT/gen_cpu.json')); print('service tokens equal cpu', a['tokens']==b['tokens'])" || tail -20 $OUT/gen_service.err
echo "== cache 100% vs 10% on cuda (demo model)"; date
python3 -c "from moebus.common.demo_model import demo_model_dir; print(demo_model_dir())"
timeout 180 python3 tools/device/cache_fidelity.py /tmp/moebus-cache/demo-qwen3_moe-v1 cuda
echo "== bench vram"; date
timeout 180 python3 -m moebus.cli bench vram 2>&1 | tee $OUT/vram.txt | tail -20
date
