# One H200: graphs vs eager correctness at 4 layers, then decode speed at 48 layers / 32 experts
# beside the HF peer (same call). Prints figures; logs under $OUT.
source tools/device/setup.sh
echo "== small model"; date
python3 -m moebus.cli init-model /tmp/m4 --preset a3b --layers 4 --experts 32 2>&1 | tail -1
timeout 150 python3 tools/device/graph_check.py /tmp/m4 2>&1 | tee $OUT/graph_check.txt | grep -v Warn | tail -12
timeout 100 python3 -m moebus.cli bench decode --model /tmp/m4 --device cuda --batch 1,8 --tokens 32 --repeats 2 --no-service 2>&1 | tail -4
MOEBUS_CUDA_GRAPHS=0 timeout 100 python3 -m moebus.cli bench decode --model /tmp/m4 --device cuda --batch 1 --tokens 16 --repeats 2 --no-service 2>&1 | tail -2
echo "== 48 layers x 32 experts"; date
time python3 -m moebus.cli init-model /tmp/m48 --preset a3b --layers 48 --experts 32 2>&1 | tail -1
df -h /tmp | tail -1
timeout 240 python3 -m moebus.cli bench decode --model /tmp/m48 --device cuda --batch 1,8 --tokens 64 --repeats 2 \
  --no-service --peer hf 2>&1 | tee $OUT/decode48.txt | grep -v Warn | tail -8
date
