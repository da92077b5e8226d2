# One H200, the figures for docs/performance.md: eager == graph after the unrolled GEMVs and the
# attention change; 48 layers x 32 experts all resident and at a 25% cache beside the HF peer;
# then 24 layers x 128 experts.
source tools/device/setup.sh
python3 -m moebus.cli init-model /tmp/m4 --preset a3b --layers 4 --experts 32 2>&1 | tail -1
timeout 60 python3 tools/device/graph_check.py /tmp/m4 2>&1 | tee $OUT/graph_check.txt | grep -v Warn | tail -5
rm -rf /tmp/m4; python3 -m moebus.cli init-model /tmp/m48 --preset a3b --layers 48 --experts 32 2>&1 | tail -1
timeout 60 python3 -m moebus.cli bench decode --model /tmp/m48 --device cuda --batch 1,8 --tokens 64 --repeats 2 \
  --no-service 2>&1 | tee $OUT/decode48.txt | grep -v Warn | tail -3
timeout 45 python3 -m moebus.cli bench decode --model /tmp/m48 --device cuda --batch 1,8 --tokens 16 --repeats 2 \
  --no-service --cache-frac 0.25 2>&1 | tee $OUT/decode48_c25.txt | grep -v Warn | tail -3
timeout 90 python3 .peer/hf_peer.py a 48 2>&1 | tee $OUT/peer48.txt | grep "tok/s"
rm -rf /tmp/m48; date
python3 -m moebus.cli init-model /tmp/m24 --preset a3b --layers 24 2>&1 | tail -1; date
timeout 60 python3 -m moebus.cli bench decode --model /tmp/m24 --device cuda --batch 1,8 --tokens 32 --repeats 2 \
  --no-service 2>&1 | tee $OUT/decode24.txt | grep -v Warn | tail -3
date
