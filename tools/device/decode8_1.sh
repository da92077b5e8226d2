# Issue 15 item 1, eighth session (branch decode8), first call (~190 s on one H200): ncu's stall
# reasons, occupancy and DRAM rate of the batch-1 GEMVs (4 x 32, replayed graph), then
# decode8_sweep.py on 48 x 32 over decode8_1.json: batch-1 tok/s, per-kernel us, the gaps between
# graph nodes and the host time around the graph, for each setting of the GEMVs' work shapes.
source tools/device/setup.sh
M=/tmp/m48
timeout 100 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $OUT/init48.log 2>&1 &
timeout 30 python3 -m moebus.cli init-model /tmp/m4 --preset a3b --layers 4 --experts 32 2>&1 | tail -1
echo "== ncu (4 x 32, batch 1)"; date
S="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats "
PROFILE_PLAIN=1 timeout 60 ncu --clock-control none -k regex:"expert_|linear_rows" --launch-skip 24 --launch-count 8 $S \
  python3 tools/device/decode_profile.py /tmp/m4 1 > $OUT/ncu.txt 2> $OUT/ncu.err
echo "ncu rc $?"; tail -2 $OUT/ncu.err
grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Grid Size|Block Limit Reg|Stall|stall" $OUT/ncu.txt | head -150
echo "== decode8_sweep 48 x 32"; date
wait; tail -1 $OUT/init48.log
timeout 150 python3 tools/device/decode8_sweep.py $M 1 tools/device/decode8_1.json 6 2>&1 | grep -v Warn \
  > $OUT/sweep48.txt; echo "sweep rc $?"
grep -A12 -- "^-- defaults:" $OUT/sweep48.txt | head -14
sed -n '/== decode8_sweep/,$p' $OUT/sweep48.txt
date
