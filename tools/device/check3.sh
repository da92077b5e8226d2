# One H200: the prompt-path loan on cuda, then decode speed side by side with the HF peer.
source tools/device/setup.sh
echo "== loan"; date
python3 -c "from moebus.common.demo_model import demo_model_dir; demo_model_dir()"
timeout 150 python3 tools/device/loan_check.py /tmp/moebus-cache/demo-qwen3_moe-v1
echo "== moebus, 6 layers of Qwen3-30B-A3B"; date
python3 -m moebus.cli init-model /tmp/a3b --preset a3b --layers 6 2>&1 | tail -1
timeout 200 python3 -m moebus.cli bench decode --model /tmp/a3b --device cuda --batch 1,8 --tokens 64 --repeats 2 \
  --no-service 2>&1 | tee $OUT/decode.txt | tail -6
echo "== HF peer, same shapes, all on the GPU"; date
timeout 200 python3 .peer/hf_peer.py a 6 2>&1 | tee $OUT/peer.txt | tail -4
date
