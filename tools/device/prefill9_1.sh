#!/usr/bin/env bash
# One H200, branch prefill9 (issue 19: the 25% cache prefill; the chunk attention kernel), ~130 s wall
# on a fresh machine. While the 48 x 32 A3B model is written (init48, background):
#   warm     prefill9_ab.py on an 8 x 32 model (REPEATS 0): compiles the prefill kernels into the disk
#            cache for the later process, and checks each copy mode's logits against all resident;
#   tests    the copier on the GPU (driver copies, chained fences), the VRAM arena's, the chunk
#            attention's (tests/cuda/test_attention_chunk.py, its captured mixed steps included);
#   kernel   chunk8_attention.py: one layer's attention of 8 decode rows + a chunk of 8/16/32 at
#            P 4096/8176, decode kernel vs tile kernel (us, largest |difference|); beside the warm-up;
# then
#   ab       prefill9_ab.py on 48 x 32: 2048 tokens at a 25% cache, modes all/numba (the merged tree),
#            all, slot-policy, slot (this branch) x 2 rounds of 3, a timeline each, all resident last.
# Logs under $OUT.
source tools/device/setup.sh
set -o pipefail
M=/tmp/m48; M8=/tmp/m8; BUDGET=${BUDGET:-130}; T0=$(date +%s)
now() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(now) )); }
([ -f $M/generation_config.json ] && echo "init48: there already" > $OUT/init48.log) || \
(timeout 100 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $OUT/init48.log 2>&1
 echo "init48 rc=$? at $(now) s" >> $OUT/init48.log) &
INIT=$!
[ -f $M8/generation_config.json ] || timeout 25 python3 -m moebus.cli init-model $M8 --preset a3b --layers 8 \
  --experts 32 > $OUT/init8.log 2>&1
echo "init8 rc=$? at $(now) s"
(timeout 75 python3 tools/device/prefill9_ab.py $M8 2048 0 1 0.25 2>&1 | grep -av "Warn\|warn(" > $OUT/warm.txt
 echo "warm rc=$? at $(now) s" >> $OUT/warm.txt) &
WARM=$!
echo "== GPU tests of the copier and the chunk attention (its captured mixed steps too) at $(now) s"
MOEBUS_TEST_GPU=1 timeout 60 python3 -m pytest -q -rfE -p no:cacheprovider tests/cuda/test_copy_fence.py \
  tests/cuda/test_vmm_arena.py tests/cuda/test_attention_chunk.py > $OUT/gpu_tests.txt 2>&1
echo "rc=$?"; grep -aE "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.txt | cut -c1-240 | head -6
echo "== one layer's attention, decode kernel vs tile kernel (beside the warm-up's compile), at $(now) s"
timeout 35 python3 tools/device/chunk8_attention.py 0,8,16,32 4096,8176 30 2>&1 | grep -av "Warn\|warn(" \
  | tee $OUT/kernel.txt
wait $WARM; cat $OUT/warm.txt | tail -8
wait $INIT; tail -1 $OUT/init48.log
echo "== prefill 2048 at a 25% cache, copy modes, at $(now) s"
timeout $(( $(left) - 2 )) python3 tools/device/prefill9_ab.py $M 2048 3 2 0.25 2>&1 | grep -av "Warn\|warn(" \
  > $OUT/ab.txt
echo "rc=$?"; grep -av "^ *[0-9]" $OUT/ab.txt | head -40
echo "end at $(now) s"
