#!/usr/bin/env bash
# One H200, branch vl12 (issue 18: a cold Qwen3-VL image's first token <= 1.0 s, the tower <= 30 ms), run by
# the lead's tools/device/lead12_call.sh twice (BUDGET seconds each):
#   PHASE=warm    (beside the other branches: nothing timed) init-model --arch qwen3_vl_moe --preset a3b
#                 --layers 4 into $Q (vlcold10's model, ~7 GB), vl12_first.py once (the tower's kernels into
#                 the vision role's cache), then vlcold10.sh's cycle once (the GPU worker's image path compiles
#                 on a fresh kernel cache: 3 s a prefill step), its output in $OUT/warm/;
#   PHASE=measure (alone on the GPU) vl12_first.py (a new image size's first encode against a replay, the
#                 blank-image warm-up, each by step and under cProfile), then vlcold10.sh's cycle (TESTS=0
#                 PROBE=0 OLD=0 SKIP_RESIDENT=1: each cold request's hand-back, start, encode, prefill and first
#                 token; the worker's start by part; the prefill steps) as it is ("base"), then again with
#                 MOEBUS_VISION_WARM_UP=0 MOEBUS_VISION_PREFORK=1 ("new", if 30 s are left: no blank-image
#                 warm-up, a spare worker forked ahead), each with CYCLE_ENV's settings too.
# FIRST_S: the seconds of vl12_first.py in the measure phase (30); B_RESERVE_S: kept for "new" (40).
source tools/device/setup.sh
set -o pipefail
T0=$(date +%s); BUDGET=${BUDGET:-120}
now() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(now) )); }
export Q=${Q:-/tmp/vl-qwen3vl-4}
VISION_CACHE=$(python3 -c "from moebus.cuda.kernels.kernel_cache import VISION_ROLE, role_cache_dir; print(role_cache_dir(None, VISION_ROLE))")
first() {  # limit_s: vl12_first.py into $OUT/first.log, its lines printed
  NUMBA_CACHE_DIR=$VISION_CACHE timeout $1 python3 tools/device/vl12_first.py ${A_PX:-1024x1024} ${B_PX:-768x1024} \
    > $OUT/first.log 2>&1
  echo "vl12_first rc=$? at $(now) s"
  grep -vE "^\s*$|Loading weights|Writing|it/s\]" $OUT/first.log | cut -c1-200 | tail -${FIRST_LINES:-70}
}
if [[ $PHASE == warm ]]; then
  ( if [[ ! -f $Q/config.json ]]; then timeout 110 python3 -m moebus.cli init-model $Q --arch qwen3_vl_moe --preset a3b \
      --layers 4 > $OUT/init.log 2>&1; fi; echo "init rc=$? at $(now) s" >> $OUT/init.log ) &
  INIT=$!
  PROFILE=0 FIRST_LINES=4 first 60
  wait $INIT; tail -1 $OUT/init.log; du -sh $Q 2>/dev/null
  mkdir -p $OUT/warm
  (( $(left) > 30 )) && OUT=$OUT/warm TESTS=0 PROBE=0 OLD=0 SKIP_RESIDENT=1 BUDGET=$(( $(left) - 3 )) \
    bash tools/device/vlcold10.sh > $OUT/warm/cycle.txt 2>&1
  echo "warm cycle rc=$? at $(now) s"; grep -E "cold image|first token|rc=" $OUT/warm/cycle.txt | head -6 | cut -c1-200
  exit 0
fi
echo "=== vl12_first at $(now) s"
first ${FIRST_S:-30}
cycle() {  # label limit_s [env...]: vlcold10.sh's cycle (the lazy broker's two cold starts) into $OUT/<label>/
  local label=$1 limit=$2; shift 2; mkdir -p $OUT/$label
  echo "=== cold cycle $label at $(now) s (limit $limit s) $*"
  [[ -f $Q/config.json ]] || echo "no model at $Q: the cycle makes it (init-model)"
  env "$@" OUT=$OUT/$label TESTS=0 PROBE=0 OLD=0 SKIP_RESIDENT=1 BUDGET=$limit timeout $(( limit + 2 )) \
    bash tools/device/vlcold10.sh 2>&1 | grep -vE "^numba|^index, name|NVIDIA H200|gpu tests not run|made already"
}
# the start as it is, then without the blank-image warm-up (the request's own encode loads the kernels) and
# from a spare forked ahead (cuInit and NVML done before the start): the worker's log splits the two by part
cycle base $(( $(left) - ${B_RESERVE_S:-40} > 35 ? $(left) - ${B_RESERVE_S:-40} : $(left) - 2 )) ${CYCLE_ENV}
(( $(left) > 30 )) && cycle new $(( $(left) - 2 )) MOEBUS_VISION_WARM_UP=0 MOEBUS_VISION_PREFORK=1 ${CYCLE_ENV}
echo "vl12 end at $(now) s"
