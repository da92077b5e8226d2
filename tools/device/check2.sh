# Two H200s: kernel tests, bench vram, then the split check on a Qwen3-30B-A3B-shaped model.
source tools/device/setup.sh
set -o pipefail
if [ -z "$SPLIT_ONLY" ]; then
echo "== kernel tests on the GPU"; date
MOEBUS_TEST_GPU=1 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/cuda 2>&1 | tail -8 | tee $OUT/gpu_tests.txt
echo "== bench vram"; date
timeout 120 python3 -m moebus.cli bench vram 2>&1 | tee $OUT/vram.txt | tail -16
fi
echo "== model"; date
python3 -m moebus.cli init-model /tmp/a3b --preset a3b --layers ${LAYERS:-6} 2>&1 | tail -1
du -sh /tmp/a3b
echo "== split"; date
timeout 420 python3 tools/device/split_check.py /tmp/a3b 2>&1 | grep -v "dense weights\|experts to host" | tee $OUT/split.txt
date
