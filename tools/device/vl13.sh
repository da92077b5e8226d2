#!/usr/bin/env bash
# One H200, branch vl13 (issue 18: a cold Qwen3-VL image's first token <= 1.0 s), run by the lead's call script:
#   PHASE=warm    (beside the other branches: nothing timed) vl12.sh's warm phase (init-model --arch qwen3_vl_moe
#                 --preset a3b --layers 4 into $Q, ~7 GB; vl12_first.py; vlcold10's cycle once: every kernel of
#                 the cycle compiled), and once $Q is made, a deeper model beside that cycle: DEEP_LAYERS (48) x
#                 DEEP_EXPERTS (8) a3b, ~7.4 GB (the full depth with a3b's per-token work: 8 of 8 experts), into
#                 $D, usable only if it finished ($D/made);
#   PHASE=measure (alone on the GPU) vlcold10.sh's cycle (1024 px, 2 text streams, two cold starts, 8192 MiB
#                 budget) on $Q: "old" (MOEBUS_VISION_WARM_UP=1 MOEBUS_VISION_PREFORK=0: the start as it was),
#                 "new" (this branch's defaults: no warm-up for a lazy start, a spare forked ahead), "load"
#                 (MOEBUS_VISION_WARM_UP=load: cuBLAS's start and the cached kernels loaded on a thread while the
#                 image is decoded, vision_preload.py); then, if $D was made and time is left, the defaults on
#                 $D (bench vision-cycle, --gpu-memory-mib DEEP_MIB, 16384); last a compact summary (each cold
#                 request's split, the worker's start, its first encode, the preload, the cuBLAS first calls).
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
    FREE_G=$(df --output=avail -BG /tmp | tail -1 | tr -dc 0-9)  # (the other branches' models share the disk)
    (( FREE_G < ${DEEP_MIN_FREE_G:-24} )) && [[ ! -f $D/made ]] && { echo "deep init not begun: $FREE_G GB free" \
      >> $OUT/init_deep.log; exit 0; }
    [[ -f $D/made ]] || { rm -rf $D; timeout $T python3 -m moebus.cli init-model $D --arch qwen3_vl_moe \
      --preset a3b --layers ${DEEP_LAYERS:-48} --experts ${DEEP_EXPERTS:-8} > $OUT/init_deep.log 2>&1 && touch $D/made \
      || { rm -rf $D; false; }; }  # (a cut one: its disk back)
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
(( $(left) > 22 )) && cycle load $(( $(left) > 50 ? 25 : $(left) - 2 )) MOEBUS_VISION_WARM_UP=load
if [[ -f $D/made ]] && (( $(left) > 25 )); then
  mkdir -p $OUT/deep; echo "=== deep cycle ($D, $(du -sh $D | cut -f1)) at $(now) s"
  timeout $(( $(left) - 2 )) python3 -m moebus.cli bench vision-cycle --device cuda --model $D -v \
    --idle-s 1 --gpu-memory-mib ${DEEP_MIB:-16384} --repeats 2 --image-px 1024 --text-streams 2 --cold-starts 2 \
    --timeout-s 120 --max-batch 4 --skip-resident > $OUT/deep/cycle.log 2>&1
  echo "deep rc=$? at $(now) s"
else
  echo "deep cycle not run ($D/made: $([[ -f $D/made ]] && echo yes || echo no), $(left) s left)"
fi
# the summary (the lead sees the tail): per variant each cold request's split, the worker's start, its first encodes
for label in old new load; do
  f=$OUT/$label/cycle.txt; [[ -f $f ]] || continue
  echo "--- $label"
  grep -E "^cold image request|^warm image encode|Traceback|Error" $f | cut -c1-160
  grep -E "vision worker start on" $f | sed -E 's/.*start on gpu0: //' | cut -c1-230
  zcat $OUT/$label/new.log.gz 2>/dev/null | grep -E "encode 1:|preload beside:|footprint:" | sed -E 's/^.*INFO //' \
    | cut -c1-200
  pids=$(zcat $OUT/$label/new.log.gz 2>/dev/null | grep -oE "moebus.vision\[[0-9]+\] INFO vision worker start on" \
    | grep -oE "[0-9]+" | sort -u | paste -sd'|')
  [[ -n $pids ]] && zcat $OUT/$label/new.log.gz | grep -E "moebus.cublas\[($pids)\]" | sed -E 's/^.*INFO cuBLAS //' \
    | cut -c1-90 | head -3
done
if [[ -f $OUT/deep/cycle.log ]]; then
  echo "--- deep"; grep -E "^cold image request|^warm image encode|Traceback|Error" $OUT/deep/cycle.log | cut -c1-160
  grep -E "vision worker start on|encode 1:" $OUT/deep/cycle.log | sed -E 's/^.*INFO //' | cut -c1-200
fi
echo "--- first token of each cold request (ms: handback / start / encode / prefill -> first token)"
for label in old new load deep; do
  f=$OUT/$label/cycle.txt; [[ $label == deep ]] && f=$OUT/deep/cycle.log; [[ -f $f ]] || f=$f.gz
  [[ -f $f ]] || continue
  zcat -f $f | grep -E "^cold image request" | sed -E "s/^cold image request ([0-9]) of [0-9]: handback ([0-9.]+) ms, \
start ([0-9.]+) ms, encode ([0-9.]+) ms, prefill ([0-9.]+) ms, first_token ([0-9.]+) ms.*/$label \1: \2 \/ \3 \/ \4 \/ \5 -> \6/"
done
[[ -f $OUT/deep/cycle.log ]] && gzip -f $OUT/deep/cycle.log
echo "vl13 end at $(now) s"
