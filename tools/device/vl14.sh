#!/usr/bin/env bash
# One H200, branch vl14 (issue 18: a cold Qwen3-VL image's first token <= 1.0 s at 48 layers), run by the lead's
# call script:
#   PHASE=warm    (beside the other branches: nothing timed) vl13.sh's warm phase as it is: the 4-layer a3b
#                 Qwen3-VL at $Q (~7 GB), vl12_first.py, one compiling cycle (the tower's kernels), and the deep
#                 model DEEP_LAYERS (48) x DEEP_EXPERTS (8) a3b at $D (~7.4 GB), usable once $D/made exists;
#   PHASE=measure (alone on the GPU, BUDGET 125 s) on $D:
#     1. vl14_prefill.py: the 1024 px image prompt's prefill in this process, steps of 510 tokens, text /
#        M-RoPE / M-RoPE + embeddings + DeepStack, warm; the full one's kernels (torch.profiler) and host time
#        (cProfile) by part. Its first pass compiles the deep model's long-step variants for the cycles too;
#     2. bench vision-cycle (1024 px, 2 text streams, 2 cold starts, 16 GiB) with MOEBUS_RESERVE_SCRATCH=beside
#        (gpu_worker.vram: while the vision reserve holds, a long step takes its scratch beside the cache where
#        the device has room, instead of a prompt-path loan from the cache: call 2 saw 36 misses, 403 MiB, a step)
#        and MOEBUS_IMAGE_STEP_TOKENS=2048 (the image prompt in one step, not three of 510: its eager launches
#        once; common/image_steps.py) and MOEBUS_VISION_WARM_UP=load (vision_preload.py: cuBLAS's start and the
#        cached kernels loaded beside the image's decode). Prefill and encode are separate phases of the cold
#        request; 1. shows the one-step part alone (full vs full1), the misses column the loan's;
#     3. the same cycle with the defaults (the loan, no preload), if time is left;
#   last a compact summary (each cold request's split, the prefill phase's steps and misses).
source tools/device/setup.sh
set -o pipefail
T0=$(date +%s); BUDGET=${BUDGET:-125}
now() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(now) )); }
export Q=${Q:-/tmp/vl-qwen3vl-4}
export D=${D:-/tmp/vl-qwen3vl-${DEEP_LAYERS:-48}x${DEEP_EXPERTS:-8}}
if [[ $PHASE == warm ]]; then
  bash tools/device/vl13.sh
  exit 0
fi
if [[ ! -f $D/made ]]; then
  echo "no deep model at $D ($(ls $D 2>&1 | head -1)); the in-process prefill on $Q instead"
  D=$Q
fi
echo "=== in-process prefill on $D ($(du -sh $D | cut -f1)) at $(now) s"
mkdir -p $OUT/prefill
OUT=$OUT/prefill timeout ${PREFILL_S:-40} python3 tools/device/vl14_prefill.py $D 1024 510 2 2>&1 \
  | grep -vE "^\s*$|Warning|warn\(" | tee $OUT/prefill/stdout.txt | cut -c1-150
echo "prefill rc=$? at $(now) s"
deep() {  # label [env...]: vl13.sh's deep cycle (bench vision-cycle on $D) into $OUT/<label>/cycle.log
  local label=$1; shift; mkdir -p $OUT/$label
  local limit=$(( $(left) - ${KEEP_S:-5} ))  # the first of two: 40 s at most, leaving the second >= 30 s
  [[ $label == beside ]] && (( limit > 40 )) && limit=$(( limit - 35 > 40 ? 40 : (limit - 35 > 30 ? limit - 35 : 30) ))
  (( limit < 20 )) && { echo "$label: not run ($(left) s left)"; return; }
  echo "=== deep cycle $label at $(now) s (limit $limit s) $*"
  env "$@" timeout $limit python3 -m moebus.cli bench vision-cycle --device cuda --model $D -v --idle-s 1 \
    --gpu-memory-mib ${DEEP_MIB:-16384} --repeats 2 --image-px 1024 --text-streams 2 --cold-starts 2 \
    --timeout-s 120 --max-batch 4 --skip-resident > $OUT/$label/cycle.log 2>&1
  echo "$label rc=$? at $(now) s"
}
deep beside MOEBUS_RESERVE_SCRATCH=beside MOEBUS_VISION_WARM_UP=load MOEBUS_IMAGE_STEP_TOKENS=2048
deep loan MOEBUS_RESERVE_SCRATCH=measured MOEBUS_VISION_WARM_UP=auto MOEBUS_IMAGE_STEP_TOKENS=0
for label in beside loan; do
  f=$OUT/$label/cycle.log; [[ -f $f ]] || continue
  echo "--- $label"
  grep -E "^cold image request|^warm image encode|Traceback|Error" $f | cut -c1-160 | head -6
  grep -E "^  (phase|prefill) |caches while they decode alone" $f | cut -c1-170
  grep -E "encode 1:|preload beside:" $f | sed -E 's/^.*INFO //' | cut -c1-150 | tail -2
  grep -cE "VRAM [0-9.]+: " $f | sed 's/^/VRAM replies: /'
  gzip -f $f
done
echo "--- first token of each cold request (ms: handback / start / encode / prefill -> first token)"
for label in beside loan; do
  f=$OUT/$label/cycle.log.gz; [[ -f $f ]] || continue
  zcat $f | grep -E "^cold image request" | sed -E "s/^cold image request ([0-9]) of [0-9]: handback ([0-9.]+) ms, \
start ([0-9.]+) ms, encode ([0-9.]+) ms, prefill ([0-9.]+) ms, first_token ([0-9.]+) ms.*/$label \1: \2 \/ \3 \/ \4 \/ \5 -> \6/"
done
echo "--- in-process prefill (ms)"; grep -E "^(text|mrope|full)|^loaded|under|Error" $OUT/prefill/stdout.txt | cut -c1-160
echo "vl14 end at $(now) s"
