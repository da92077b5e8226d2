#!/usr/bin/env bash
# Issue 16, nineteenth session (branch mma19): the FP8 attention projections at batch 1 on tensor cores
# (linear_quant_mma.py, MOEBUS_QUANT_MMA=attn; the experts' moe_quant_mma beside them). lead12_call.sh's convention:
# PHASE=warm (beside the other branches, BUDGET ~110 s; nothing timed): quant17.sh's warm phase with TESTS = this
#   branch's GPU tests (test_linear_quant_mma.py, test_moe_quant_mma.py) and PLAN (default quant19b_plan.json;
#   quant19_plan.json: call A's) (a 1-layer a3b model; QUICK sweeps of the plan compile every kernel the measure phase runs
#   into /tmp/quant17-nc).
# PHASE=measure (alone, BUDGET ~185 s), or unset (one phase: the tests first, and the decode compiles cold):
#   (1) the GPU tests, only where the warm phase did not pass them (at most 60 s);
#   (2) (BENCH=1 only) tools/device/mma19_bench.py: A3B q|k|v (2048 -> 5120) and o (4096 -> 2048), 16 layers' weights rotating,
#       us a launch behind a spin kernel (median of 200, no PDL), the numba one-round kernel against the tensor-core
#       kernel at its swept shapes, max abs / rel error against the numba output; then the experts' fp8 gate|up
#       (mma18_bench.py's way): the default and (1, 8, 2, 3) (at most 55 s);
#   (3) quant17.sh's measure phase: quant17_bench.py on $M48 over $PLAN (quant19b_plan.json: bf16; fp8 + fp8
#       attention: defaults, the projections' weights before the wait (linear_quant_fp8.LOAD_BEFORE_WAIT) with the
#       experts on tensor cores, the same with the projections too, gate|up at (1, 8, 2, 3), the candidate again;
#       int4: defaults, int4 + attention with and without the early weights; quant19_plan.json is call A's, as run;
#       names of at most 18 characters: the summary cuts them), in the time left but QUALITY_S (a cut loses the last);
#   (4) with QMODEL (tools/train_tiny_moe.py's trained bf16 model, carried): tools/device/mma19_quality.py, top-1 and
#       KL against bf16 at batch 1 with the tensor-core kernels off and on (fp8 / int4 experts, FP8 attention).
# BUDGET: ~185 s without QMODEL, ~255 with it.
# The summary last; details in $OUT (gpu_tests.txt / tests.txt, bench.txt, bench.json, sweep.txt, table.txt).
source tools/device/setup.sh
source tools/device/steps.sh
export MOEBUS_SITE_READY=1  # quant17.sh below sources setup.sh again
set -o pipefail
export M48=${M48:-/tmp/m48}  # lead12_call.sh makes it in its warm phase
PHASE=${PHASE:-one}; BUDGET=${BUDGET:-185}; OUT=${OUT:-/tmp/mma19-out}; mkdir -p $OUT; T0=$(date +%s)
T=tests/cuda
export TESTS="$T/test_linear_quant_mma.py $T/test_moe_quant_mma.py"
export PLAN=${PLAN:-quant19b_plan.json}  # quant19_plan.json: call A's, as run
QNC=/tmp/mma19-qnc  # the trained model's kernels (its own shapes), compiled in warm by a 4-step run
if [ "$PHASE" = warm ]; then
  [ -n "$QMODEL" ] && (NUMBA_CACHE_DIR=$QNC timeout $(( BUDGET - 10 )) python3 tools/device/mma19_quality.py $QMODEL \
    $QMODEL/held_out_texts.json 1 4 > $OUT/quality_warm.txt 2>&1; echo "quality warm rc=$?" >> $OUT/quality_warm.txt) &
  PHASE=warm BUDGET=$BUDGET OUT=$OUT bash tools/device/quant17.sh
  wait; tail -2 $OUT/quality_warm.txt 2>/dev/null | cut -c1-200
  exit 0
fi
passed() { grep -qE "[0-9]+ passed" $1 2>/dev/null && ! grep -qE "[0-9]+ (failed|error)" $1; }
passed $OUT/gpu_tests.txt || SHOW=4 step tests 20 60 env NUMBA_CACHE_DIR=/tmp/quant17-numba-tests MOEBUS_TEST_GPU=1 \
  python3 -m pytest -x -q -p no:cacheprovider -rf $TESTS
mkdir -p /tmp/quant17-nc/moe_quant_mma  # the tests' NVRTC cubins (every swept shape) serve the bench
cp -n /tmp/quant17-numba-tests/moe_quant_mma/*.cubin /tmp/quant17-nc/moe_quant_mma/ 2>/dev/null
[ -n "$BENCH" ] && NUMBA_CACHE_DIR=/tmp/quant17-nc SHOW=3 step bench 20 55 \
  python3 tools/device/mma19_bench.py --json $OUT/bench.json
QS=0; [ -n "$QMODEL" ] && QS=${QUALITY_S:-70}  # seconds kept for the trained model's quality (mma19_quality.py)
[ $(( $(left) - QS )) -ge 66 ] && PHASE=measure BUDGET=$(( $(left) - QS - 2 )) OUT=$OUT bash tools/device/quant17.sh \
  > $OUT/decode.txt 2>&1
[ -n "$QMODEL" ] && NUMBA_CACHE_DIR=$QNC SHOW=5 step quality 20 $QS \
  python3 tools/device/mma19_quality.py $QMODEL $QMODEL/held_out_texts.json ${QPROMPTS:-4} ${QSTEPS:-128}
echo "== mma19 ($PHASE) at $(at): tests"
for f in gpu_tests tests; do grep -E "passed|failed|error" $OUT/$f.txt 2>/dev/null | tail -1 | cut -c1-160
  grep -E "^FAILED|^ERROR" $OUT/$f.txt 2>/dev/null | head -2 | cut -c1-160; done
sed -n '/== mma19 summary/,$p' $OUT/bench.txt 2>/dev/null | grep -v '^{' | cut -c1-150
grep '^{' $OUT/quality.txt 2>/dev/null | cut -c1-230
sed -n '/== quant15 summary/,$p' $OUT/decode.txt 2>/dev/null | grep -vE "^gpu tests|^\s*$" | cut -c1-120
grep -E "skipped|FAILED" $OUT/decode.txt 2>/dev/null | head -3 | cut -c1-150
