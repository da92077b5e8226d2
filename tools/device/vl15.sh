#!/usr/bin/env bash
# One H200, branch vl15 (issue 18: the Qwen3-VL tower <= 30 ms warm at 1024x768; the cold first token at 48 layers),
# run by the lead's call script (lead12_call.sh, S=15):
#   PHASE=warm    (beside the other branches: nothing timed; ends within BUDGET, 120 s)
#     a. the deep model DEEP_LAYERS (48) x DEEP_EXPERTS (8) a3b into $D (~7.3 GB, vl13.sh's recipe; usable once
#        $D/made exists), then one deep cycle cut at the budget: the language side's kernels compiled into the cache;
#     b. vl15_encode.py warm: the a3b tower's random bf16 weights saved to $WEIGHTS (1.1 GB), each switch's way
#        encoded once (compiles, NVRTC too); then the new kernels' GPU tests (bit for bit against the kernels they replace) and
#        vl15_fidelity.py (the switches off and on against float32 transformers, bar 1e-3);
#   (call A's results made the held LayerNorm, the two-part GELU, rope_planes by pairs and COLLECT_BESIDE the defaults:
#   vl15_encode.py sets each way's switches itself, "old" all off, "defaults" those four)
#   PHASE=measure (alone on the GPU, BUDGET 80 s)
#     1. vl15_encode.py 20 (ENCODE_S, 42 s): the tower's warm encode, median of 20, integ15's way against each switch
#        (held LayerNorm, two-part GELU, COLLECT_BESIDE, rope_planes by pairs, patchify by frame) and all of them,
#        bits against integ15's; one replay by phase; the GPU time by kernel and the gaps between kernels, old and all;
#     2. the deep cycle (bench vision-cycle on $D: 1024 px, 2 text streams, 2 cold starts, 16 GiB) with the defaults
#        (call A ran it with all five switches on): each cold request's first token;
#   a short summary last.
source tools/device/setup.sh
set -o pipefail
T0=$(date +%s); BUDGET=${BUDGET:-80}
now() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(now) )); }
export D=${D:-/tmp/vl-qwen3vl-${DEEP_LAYERS:-48}x${DEEP_EXPERTS:-8}} WEIGHTS=${WEIGHTS:-/tmp/vl15-tower.npz}
SWITCHES="MOEBUS_LAYERNORM_HELD=1 MOEBUS_SPLIT_TWO_PARTS=1 MOEBUS_TOWER_COLLECT_BESIDE=1 MOEBUS_FLASH_ROPE_PAIRS=1 \
MOEBUS_PATCHIFY_BY_FRAME=1"
cycle() {  # label limit_s [env...]: bench vision-cycle on $D into $OUT/<label>/cycle.log, in its own process group
  local label=$1 limit=$2; shift 2; mkdir -p $OUT/$label
  echo "=== deep cycle $label at $(now) s (limit $limit s) $*"
  env "$@" setsid timeout -k 3 $limit python3 -m moebus.cli bench vision-cycle --device cuda --model $D -v --idle-s 1 \
    --gpu-memory-mib ${DEEP_MIB:-16384} --repeats 2 --image-px 1024 --text-streams 2 --cold-starts 2 --timeout-s 120 \
    --max-batch 4 --skip-resident > $OUT/$label/cycle.log 2>&1 &
  local pid=$!; wait $pid; local rc=$?
  kill -9 -- -$pid 2>/dev/null  # (what the bench started and left behind: its process group)
  echo "$label rc=$rc at $(now) s"
}
if [[ $PHASE == warm ]]; then
  BUDGET=$(( BUDGET - 6 ))
  ( FREE_G=$(df --output=avail -BG /tmp | tail -1 | tr -dc 0-9)
    if [[ ! -f $D/made ]] && (( FREE_G < ${DEEP_MIN_FREE_G:-24} )); then echo "deep init not begun: $FREE_G GB free"
    elif [[ ! -f $D/made ]]; then
      rm -rf $D; timeout $(( $(left) - 2 )) python3 -m moebus.cli init-model $D --arch qwen3_vl_moe --preset a3b \
        --layers ${DEEP_LAYERS:-48} --experts ${DEEP_EXPERTS:-8} > $OUT/init_deep.log 2>&1 && touch $D/made \
        || { echo "deep init rc=$? at $(now) s: cut"; rm -rf $D; }
    fi
    echo "deep model $([[ -f $D/made ]] && du -sh $D | cut -f1 || echo none) at $(now) s"
    (( $(left) > 15 )) && [[ -f $D/made ]] && cycle warm_cycle $(( $(left) - 2 ))
    gzip -f $OUT/warm_cycle/cycle.log 2>/dev/null ) > $OUT/deep_warm.txt 2>&1 &
  DEEP=$!
  echo "== vl15_encode.py warm at $(now) s"
  timeout $(( $(left) - 2 )) python3 tools/device/vl15_encode.py warm 2>&1 | grep -vE "^\s*$|Warning|warn\(" | tail -12
  echo "== GPU tests at $(now) s"
  (( $(left) > 20 )) && env $SWITCHES MOEBUS_TEST_GPU=1 timeout $(( $(left) - 2 )) python3 -m pytest -q -p no:cacheprovider \
    tests/cuda/test_layernorm_held.py tests/cuda/test_split_two_parts.py tests/cuda/test_flash_attention.py \
    tests/vision/test_qwen3vl_tower_tc.py tests/cuda/test_patchify.py -k "held or two or rope_planes_kernel or tower or kernel_equals" \
    2>&1 | tail -6
  echo "== fidelity at $(now) s"
  (( $(left) > 20 )) && timeout $(( $(left) - 2 )) python3 tools/device/vl15_fidelity.py 2>&1 | grep -E "^fidelity|Error" | tail -10
  wait $DEEP; cat $OUT/deep_warm.txt; df -h /tmp | tail -1
  echo "vl15 warm end at $(now) s"
  exit 0
fi
echo "=== tower at $(now) s"
BUDGET_S=$(( ${ENCODE_S:-42} - 2 )) timeout ${ENCODE_S:-42} python3 tools/device/vl15_encode.py ${REPEATS:-20} 2>&1 \
  | grep -vE "^\s*$|Warning|warn\(" | tee $OUT/encode.txt | cut -c1-170
echo "tower rc=$? at $(now) s"
if [[ -f $D/made ]] && (( $(left) > 25 )); then cycle deep $(( $(left) - 3 ))  # (the defaults: four of the switches since call A)
else echo "deep cycle not run ($D/made: $([[ -f $D/made ]] && echo yes || echo no), $(left) s left)"; fi
f=$OUT/deep/cycle.log
[[ -f $f ]] && { grep -E "^  (phase|prefill) |encode 1:|preload beside:|Traceback|Error" $f | sed -E 's/^.*INFO //' \
  | cut -c1-150 | tail -6; gzip -f $f; }
echo "--- summary (vl15, at $(now) s)"
grep -E "^(old|defaults|all|beside|held|two|pairs|frame|held 2 warps|held 1 warp|old again|defaults again) +warm" $OUT/encode.txt | sed -E 's/ \(median of [0-9]+; ([a-z, ]+); eager \+ capture [0-9.]+ s\)/ (\1)/' | cut -c1-140
grep -E "^GPU of one|^  (collect|upload|graph|GPU)" $OUT/encode.txt | cut -c1-150
grep -E "^SUMMARY" $OUT/encode.txt
[[ -f $f.gz ]] && zcat $f.gz | grep -E "^cold image request|^warm image encode" | cut -c1-160
echo "vl15 end at $(now) s"
