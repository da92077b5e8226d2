#!/usr/bin/env bash
# One H200, branch vlcold10 (issue 18: a cold Qwen3-VL image request's first token <= 1.0 s after the
# hand-back). In one call (BUDGET seconds of wall, default 190):
#   1. beside the model's build (init-model --arch qwen3_vl_moe --preset a3b --layers 4, merged9b's):
#      the GPU tests of the tower's capture after an eager first encode (graph == eager bit for bit),
#      and vlcold10_probe.py (the start's parts after a fork, with and without the zygote's preloads,
#      whether those are safe; a 800 MiB upload pageable against pinned chunks);
#   2. merged9b's Qwen3-VL cycle: bench vision-cycle --device cuda --gpu-memory-mib 8192 --image-px 1024
#      --text-streams 2 --cold-starts 2 --repeats 2 --max-batch 4 (8 decode graphs, not 16: a shorter worker start on a
#      fresh kernel cache), and the vision worker's own lines (its start by
#      part, each encode by part, the capture after the reply) for both cold starts;
#   3. if time is left: the same cycle with the ninth session's start (MOEBUS_TOWER_EAGER_FIRST=0
#      MOEBUS_VISION_PACK=0 MOEBUS_VISION_PRELOAD=0) as the A/B in the same call.
# SKIP_RESIDENT=1 leaves row (a) out (~40 s less on a fresh machine); TESTS=0 the GPU tests; BUDGET=200 for all.
# PROBE=0 leaves the probe out, OLD=0 step 3; a model already at $Q (made by a caller, vl11.sh) is not made again.
source tools/device/setup.sh
set -o pipefail
T0=$(date +%s); BUDGET=${BUDGET:-190}
now() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(now) )); }
Q=${Q:-/tmp/a3b-qwen3vl-4}  # (a caller may name its own)
if [[ -f $Q/config.json ]]; then
  ( echo "init: $Q made already" > $OUT/init.log ) &
else
  ( timeout 100 python3 -m moebus.cli init-model $Q --arch qwen3_vl_moe --preset a3b --layers 4 > $OUT/init.log 2>&1;
    echo "init rc=$? at $(now) s" >> $OUT/init.log ) &
fi
INIT=$!
# the tests compile the tower's kernels into the vision role's cache, which the cycle's vision worker then loads
VISION_CACHE=$(python3 -c "from moebus.cuda.kernels.kernel_cache import VISION_ROLE, role_cache_dir; print(role_cache_dir(None, VISION_ROLE))")
if [[ ${TESTS:-1} == 1 ]]; then
  ( NUMBA_CACHE_DIR=$VISION_CACHE MOEBUS_TEST_GPU=1 timeout ${TESTS_S:-60} python3 -m pytest -q -p no:cacheprovider \
      tests/vision/test_tower_capture_after_reply.py tests/vision/test_qwen3vl_units.py -k "captured or capture" \
      > $OUT/gputest.log 2>&1; echo "gpu tests rc=$? at $(now) s" >> $OUT/gputest.log ) &
else
  ( echo "gpu tests not run (TESTS=0)" > $OUT/gputest.log ) &
fi
TESTS_PID=$!
PRELOAD=1
if [[ ${PROBE:-1} == 1 ]]; then
  timeout 60 python3 tools/device/vlcold10_probe.py 800 > $OUT/probe.log 2>&1
  echo "=== probe (rc=$?, at $(now) s)"; cut -c1-700 $OUT/probe.log | grep -v "^\s*$" | tail -20
  grep -q "preload safe: True" $OUT/probe.log || { PRELOAD=0; echo "preloads off for the cycle"; }
fi
wait $TESTS_PID; echo "=== GPU tests"; tail -4 $OUT/gputest.log | cut -c1-300
wait $INIT; tail -2 $OUT/init.log | cut -c1-200

cycle() {  # name limit_s [env...]: the cycle, then its summary lines and the vision worker's own
  local name=$1 limit=$2; shift 2
  echo "=== cycle $name at $(now) s (limit $limit s) $*"
  env "$@" timeout $limit python3 -m moebus.cli bench vision-cycle --device cuda --model $Q --gpu-memory-mib 8192 -v \
    --idle-s 1 --repeats 2 --image-px 1024 --text-streams 2 --cold-starts 2 --timeout-s 120 --max-batch ${MAX_BATCH:-4} \
    ${SKIP_RESIDENT:+--skip-resident} > $OUT/$name.log 2>&1
  echo "rc=$?"
  grep -vE "^\{" $OUT/$name.log | grep -E "^\(|^  |cold image|text streams|warm image|target|not checked" | cut -c1-230
  grep -E "vision worker start on|was a spare|spare vision worker|libraries loaded since|encode [0-9]:|captured after its reply|zygote preloaded|vision worker footprint|vision worker kernels|vision worker ready|Traceback|Error" \
    $OUT/$name.log | grep -v "CUDA_ERROR_NOT_READY" | cut -c1-400 | head -40
  grep -E "gpu0: decode step .* took" $OUT/$name.log | tail -6 | cut -c1-200
  grep -E "^\{" $OUT/$name.log | tail -1 | python3 -c "
import json, sys
d = json.loads(sys.stdin.read())
for s in d.get('earlier_splits', []) + [d['split']]:
    print('split', {k: (round(v * 1e3, 1) if isinstance(v, float) else v) for k, v in s.items() if k != 'steps'})
    print('  steps by phase', json.dumps(s.get('steps'))[:900])
" 2>&1 | cut -c1-1000
  gzip -f $OUT/$name.log
}
# on a fresh machine the cycle took ~72 s with row (a) (its broker compiles the GPU worker's kernels), ~25 s
# without it and with the caches warm; the first call cut it at 72 s, 0.2 s before it printed: give it room
cycle new $(( $(left) > 150 ? 150 : $(left) - 3 )) MOEBUS_VISION_PRELOAD=$PRELOAD
if [[ ${OLD:-1} == 1 ]] && (( $(left) > 75 )); then
  cycle old $(( $(left) - 5 )) MOEBUS_TOWER_EAGER_FIRST=0 MOEBUS_VISION_PACK=0 MOEBUS_VISION_PRELOAD=0
fi
echo "end at $(now) s"
