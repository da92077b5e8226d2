#!/usr/bin/env bash
# Issue 16, twentieth session, call A (one H200, alone): where the int4 + fp8-attention b1 layer's 41.7 us go.
#   (1) beside init-model of the 48 x 32 a3b model (CPU): Nsight Compute on the tensor-core GEMVs as
#       mma18_bench.py / mma19_bench.py launch them (int4 gate|up and down, fp8 gate|up, the fp8 q|k|v projection:
#       the defaults' shapes, one launch each after 8; sections: speed of light, memory, occupancy, warp states,
#       scheduler, launch) -> $OUT/ncu_*.txt;
#   (2) quant17_bench.py on $M48 over $PLAN (quant20_plan.json: bf16 and each quantized pair with PDL off, i.e. every
#       kernel's true duration by CUPTI; the o projection at (1, 8, 8, 1); int4 experts with bf16 attention).
#   LM_PLAN (optional): the plan again with lm_head.dtype fp8 (LM_S s); QMODEL: tools/device/$QSCRIPT (quality20.py) on that trained
#   model (QUALITY_S s, QPROMPTS texts x QSTEPS steps);
#   LAYERS, EXPERTS: the model's (48, 32; the twenty-fourth session: M48=/tmp/m16x128 LAYERS=16 EXPERTS=128);
#   TESTS (optional): GPU tests run first (MOEBUS_TEST_GPU=1, at most TESTS_S s, default 150); NO_NCU=1 skips (1).
# BUDGET ~330 s. The summary last; $OUT/table.txt has every kernel of every setting.
source tools/device/setup.sh
source tools/device/steps.sh
set -o pipefail
BUDGET=${BUDGET:-330}; OUT=${OUT:-/tmp/lead20}; mkdir -p $OUT; T0=$(date +%s)
M48=${M48:-/tmp/m48}; NC=/tmp/quant20-nc; PLAN=tools/device/${PLAN:-quant20_plan.json}
export NUMBA_CACHE_DIR=$NC
command -v ncu >/dev/null || export PATH=$PATH:/usr/local/cuda/bin:$(ls -d /opt/nvidia/nsight-compute/*/ 2>/dev/null | tail -1)
( timeout 150 python3 -m moebus.cli init-model $M48 --preset a3b --layers ${LAYERS:-48} --experts ${EXPERTS:-32} > $OUT/init48.txt 2>&1
  echo "init48 rc=$? at $(at)" >> $OUT/init48.txt ) &
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
  --section SchedulerStats --section LaunchStats"
prof() {  # NAME KERNEL_REGEX COMMAND...
  local name=$1 regex=$2; shift 2
  timeout 60 ncu $SECTIONS --kernel-name regex:$regex --launch-skip 8 --launch-count 1 "$@" > $OUT/ncu_$name.txt 2>&1
  echo "ncu $name rc=$? at $(at)"
}
if [ -z "$NO_NCU" ]; then
  prof int4_gate_up moe_quant_mma_gate_up python3 tools/device/mma18_bench.py --formats int4
  prof int4_down moe_quant_mma_down python3 tools/device/mma18_bench.py --formats int4
  prof fp8_gate_up moe_quant_mma_gate_up python3 tools/device/mma18_bench.py --formats fp8
  prof fp8_qkv linear_quant_mma python3 tools/device/mma19_bench.py --parts dense
fi
[ -n "$TESTS" ] && SHOW=6 step tests 30 ${TESTS_S:-150} env MOEBUS_TEST_GPU=1 python3 -m pytest -q -x -p no:cacheprovider \
  -rf $TESTS
wait
tail -1 $OUT/init48.txt
SHOW=4 step sweep 60 $(( BUDGET - 8 )) python3 tools/device/quant17_bench.py $M48 $PLAN 4
python3 tools/device/quant9_sweep.py --table $OUT/sweep.txt > $OUT/table.txt 2>&1
python3 tools/device/quant17_bench.py --summary $OUT/sweep.txt | tee $OUT/summary.txt
if [ -n "$LM_PLAN" ]; then  # the same sweep with the FP8 lm_head (lm_head.dtype fp8), its own bf16 row first
  LM_HEAD_DTYPE=fp8 SHOW=2 step sweep_lm 40 ${LM_S:-120} python3 tools/device/quant17_bench.py $M48 tools/device/$LM_PLAN 4
  python3 tools/device/quant17_bench.py --summary $OUT/sweep_lm.txt | tee $OUT/summary_lm.txt
fi
[ -n "$QMODEL" ] && SHOW=8 step quality 30 ${QUALITY_S:-150} python3 tools/device/${QSCRIPT:-quality20.py} $QMODEL \
  $QMODEL/held_out_texts.json ${QPROMPTS:-4} ${QSTEPS:-128}
for f in $OUT/ncu_*.txt; do echo "== $f"; grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Compute \(SM\)|Warp Cycles Per Issued|No Eligible|One or More" $f | head -12; done
echo "lead20 end at $(at)"
