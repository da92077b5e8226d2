source tools/device/setup.sh
python3 -m moebus.cli init-model /tmp/m48 --preset a3b --layers 48 --experts 32 2>&1 | tail -1
timeout 200 python3 tools/device/op_profile.py /tmp/m48 1 8 2>&1 | tee $OUT/op_profile.txt | grep -v Warn | tail -44
