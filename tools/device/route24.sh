#!/usr/bin/env bash
# One H200 (twenty-fourth session): route_end's WIDE path (> 32 experts) timed by Nsight Compute against route_tail on
# one token of Qwen3-30B-A3B's routing (tools/device/route24_bench.py: bits compared first), WIDE_THREADS 256 / 512 /
# 1024, then TESTS (GPU tests), or with LEAD=1 lead20.sh's TESTS and sweep where BUDGET allows (M48=/tmp/m16x128
# LAYERS=16 EXPERTS=128 PLAN=quant24_plan.json). Call E: the WIDE path a warp an expert's rank (route_end.cu).
#   LEAD=1 TESTS=... BUDGET=330 bash tools/device/route24.sh
source tools/device/setup.sh
command -v ncu >/dev/null || export PATH=$PATH:/usr/local/cuda/bin:$(ls -d /opt/nvidia/nsight-compute/*/ 2>/dev/null | tail -1)
for v in ${VARIANTS:-route_tail 256 512 1024}; do
  timeout 60 ncu --metrics gpu__time_duration.sum --kernel-name regex:"route_end|route_tail" --launch-skip 10 \
    --launch-count 30 python3 tools/device/route24_bench.py $v > $OUT/ncu_$v.txt 2>&1
  us=$(grep -E "gpu__time_duration.sum" $OUT/ncu_$v.txt | awk '{print $NF, $(NF-1)}' | python3 -c "
import sys, statistics
v = [float(a) * (1e-3 if u.startswith('n') else 1.0) for a, u in (l.split() for l in sys.stdin)]
print(f'{statistics.median(v):.2f} us median of {len(v)} (min {min(v):.2f}, max {max(v):.2f})' if v else 'none')")
  echo "$v rc=$?: $(grep -h 'bit for bit' $OUT/ncu_$v.txt | cut -c1-100); $us"
done
if [ -n "$TESTS" ] && [ -z "$LEAD" ]; then  # the GPU tests alone (LEAD runs them in lead20.sh)
  MOEBUS_TEST_GPU=1 timeout ${TESTS_S:-100} python3 -m pytest -q -p no:cacheprovider -rf --tb=short -W ignore $TESTS \
    > $OUT/tests.txt 2>&1
  echo "GPU tests rc=$? at ${SECONDS} s: $(tail -1 $OUT/tests.txt | cut -c1-120)"; grep -E "^FAILED|Error" $OUT/tests.txt | head -6
fi
if [ -n "$LEAD" ]; then
  M48=/tmp/m16x128 LAYERS=16 EXPERTS=128 NO_NCU=1 PLAN=quant24_plan.json BUDGET=$((BUDGET - SECONDS)) \
    bash tools/device/lead20.sh 2>&1 | grep -E "passed|failed|rc |b1 |route_end v0|route_tail v0" | cut -c1-160
  grep -E "route_end v0|route_tail v0|^-- " $OUT/table.txt | cut -c1-120
fi
