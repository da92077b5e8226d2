#!/usr/bin/env bash
# One H200, branch vl13 (issue 18: a cold Qwen3-VL image's first token <= 1.0 s), run by the lead's call script:
#   PHASE=warm    (beside the other branches: nothing timed) vl12.sh's warm phase (init-model --arch qwen3_vl_moe
#                 --preset a3b --layers 4 into $Q, ~7 GB; vl12_first.py; vlcold10's cycle once: every kernel of
#                 the cycle compiled), and once $Q is made, a deeper model beside that cycle: DEEP_LAYERS (48) x
#                 DEEP_EXPERTS (8) a3b, ~7.4 GB (the full depth with a3b's per-token work: 8 of 8 experts), into
#                 $D, usable only if it finished ($D/made);
#   PHASE=measure (alone on the GPU) vlcold10.sh's cycle (1024 px, 2 text streams, two cold starts, 8192 MiB
#                 budget) on $Q: "old" (MOEBUS_VISION_WARM_UP=1 MOEBUS_VISION_PREFORK=0: the start as
#                 it was), "new" (this branch's defaults: no warm-up, a spare forked ahead) and "beside"
#                 (MOEBUS_VISION_WARM_UP=beside: the warm-up on a thread during the image's decode), that one
#                 after the defaults on $D (bench vision-cycle, --gpu-memory-mib DEEP_MIB, 16384) where $D was
#                 made, each if time is left; last a compact summary (each cold request's split, the worker's
#                 start and first encodes).
source tools/device/setup.sh
set -o pipefail
T0=$(date +%s); BUDGET=${BUDGET:-110}
now() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(now) )); }
export Q=${Q:-/tmp/vl-qwen3vl-4}
D=${D:-/tmp/vl-qwen3vl-${DEEP_LAYERS:-48}x${DEEP_EXPERTS:-8}}
if [[ $PHASE == warm ]]; then
  ( for i in $(seq 1 ${DEEP_WAIT_S:-100}); do [[ -f $Q/config.json ]] && grep -q "init rc=0" $OUT/init.log 2>/dev/null && break
      sleep 1; done
    T=$(( $(left) - 4 ))
    (( T < 20 )) && { echo "deep init not begun: $T s left" >> $OUT/init_deep.log; exit 0; }
    [[ -f $D/made ]] || { rm -rf $D; timeout $T python3 -m moebus.cli init-model $D --arch qwen3_vl_moe \
      --preset a3b --layers ${DEEP_LAYERS:-48} --experts ${DEEP_EXPERTS:-8} > $OUT/init_deep.log 2>&1 && touch $D/made; }
    echo "deep init rc=$? at $(now) s" >> $OUT/init_deep.log ) &
  DEEP=$!
  BUDGET=$(( BUDGET - 4 )) bash tools/device/vl12.sh
  wait $DEEP; tail -1 $OUT/init_deep.log; du -sh $Q $D 2>/dev/null; df -h /tmp | tail -1
  exit 0
fi
cycle() {  # label limit_s [env...]: vlcold10.sh's cycle on $Q (two cold starts) into $OUT/<label>/
  local label=$1 limit=$2; shift 2; mkdir -p $OUT/$label
  echo "=== cycle $label at $(now) s (limit $limit s) $*"
  env "$@" OUT=$OUT/$label TESTS=0 PROBE=0 OLD=0 SKIP_RESIDENT=1 BUDGET=$limit timeout $(( limit + 2 )) \
    bash tools/device/vlcold10.sh > $OUT/$label/cycle.txt 2>&1
  echo "$label rc=$? at $(now) s"
}
[[ -f $Q/config.json ]] || echo "no model at $Q: the first cycle makes it (init-model)"
cycle old 25 MOEBUS_VISION_WARM_UP=1 MOEBUS_VISION_PREFORK=0
cycle new $(( $(left) > 50 ? 25 : $(left) - 2 ))
if [[ -f $D/made ]] && (( $(left) > 30 )); then
  mkdir -p $OUT/deep; echo "=== deep cycle ($D, $(du -sh $D | cut -f1)) at $(now) s"
  timeout $(( $(left) > 60 ? 38 : $(left) - 2 )) python3 -m moebus.cli bench vision-cycle --device cuda --model $D -v \
    --idle-s 1 --gpu-memory-mib ${DEEP_MIB:-16384} --repeats 2 --image-px 1024 --text-streams 2 --cold-starts 2 \
    --timeout-s 120 --max-batch 4 --skip-resident > $OUT/deep/cycle.log 2>&1
  echo "deep rc=$? at $(now) s"
else
  echo "deep cycle not run ($D/made: $([[ -f $D/made ]] && echo yes || echo no), $(left) s left)"
fi
(( $(left) > 22 )) && cycle beside $(( $(left) - 2 )) MOEBUS_VISION_WARM_UP=beside
# the summary (the lead sees the tail): per variant each cold request's split, the worker's start, its first encodes
for label in old new beside; do
  f=$OUT/$label/cycle.txt; [[ -f $f ]] || continue
  echo "--- $label"
  grep -E "^cold image request|^warm image encode|Traceback|Error" $f | cut -c1-160
  grep -E "vision worker start on" $f | sed -E 's/.*start on gpu0: //' | cut -c1-230
  grep -E "encode 1:|warm-up beside:|footprint:" $f | sed -E 's/^.*INFO //' | cut -c1-200
done
if [[ -f $OUT/deep/cycle.log ]]; then
  echo "--- deep"; grep -E "^cold image request|^warm image encode|Traceback|Error" $OUT/deep/cycle.log | cut -c1-160
  grep -E "vision worker start on|encode 1:" $OUT/deep/cycle.log | sed -E 's/^.*INFO //' | cut -c1-200
  gzip -f $OUT/deep/cycle.log
fi
echo "vl13 end at $(now) s"
