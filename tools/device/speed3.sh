# One H200: fused kernels (qkv + norm + rope + KV store, combine + add + norm), attention V tile;
# eager == graph; op profile; decode at 48 layers all resident and at a 25% cache.
source tools/device/setup.sh
python3 -m moebus.cli init-model /tmp/m4 --preset a3b --layers 4 --experts 32 2>&1 | tail -1
timeout 150 python3 tools/device/graph_check.py /tmp/m4 2>&1 | tee $OUT/graph_check.txt | grep -v Warn | tail -6
python3 -m moebus.cli init-model /tmp/m48 --preset a3b --layers 48 --experts 32 2>&1 | tail -1
timeout 150 python3 -m moebus.cli bench decode --model /tmp/m48 --device cuda --batch 1,8 --tokens 64 --repeats 2 \
  --no-service 2>&1 | tee $OUT/decode48.txt | grep -v Warn | tail -3
timeout 150 python3 tools/device/op_profile.py /tmp/m48 1 8 2>&1 | tee $OUT/op_profile.txt | grep -v Warn | tail -40
