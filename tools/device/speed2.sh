# One H200: fused kernels still give eager == graph tokens; op profile at 48 layers; decode speed
# all resident and at a 25% cache.
source tools/device/setup.sh
echo "== small model"; date
python3 -m moebus.cli init-model /tmp/m4 --preset a3b --layers 4 --experts 32 2>&1 | tail -1
timeout 150 python3 tools/device/graph_check.py /tmp/m4 2>&1 | tee $OUT/graph_check.txt | grep -v Warn | tail -6
echo "== 48 layers x 32 experts"; date
python3 -m moebus.cli init-model /tmp/m48 --preset a3b --layers 48 --experts 32 2>&1 | tail -1
timeout 120 python3 tools/device/op_profile.py /tmp/m48 1 8 2>&1 | tee $OUT/op_profile.txt | grep -v Warn | tail -44
timeout 150 python3 -m moebus.cli bench decode --model /tmp/m48 --device cuda --batch 1,8 --tokens 64 --repeats 2 \
  --no-service 2>&1 | tee $OUT/decode48.txt | grep -v Warn | tail -4
timeout 150 python3 -m moebus.cli bench decode --model /tmp/m48 --device cuda --batch 1,8 --tokens 32 --repeats 2 \
  --no-service --cache-frac 0.25 2>&1 | tee $OUT/decode48_c25.txt | grep -v Warn | tail -4
date
