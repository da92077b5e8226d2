#!/usr/bin/env bash
# The lead's part of the fifteenth session's calls (lead12_call.sh with S=15, part "lead"): the merged tree with
# the defaults flipped at the session's start (a cache that evicts launches ahead, decode attention's owner
# softmax + exp2 + 4 rows ahead + 2 blocks an SM, the reserve's scratch beside, image steps of 2048, the preload).
#   PHASE=warm     (beside the other branches; nothing timed) with TESTS=1 the GPU tests of what changed; the
#                  measure phase's benches on a 4 x 32 a3b model (/tmp/lead-m4, compiles), graph == eager there;
#   PHASE=final    (call C, alone; GPU_TESTS overrides the test files) a worker's start twice (kernels from the disk cache), the GPU tests of the
#                  merged branches, graph == eager, b1/b8 in-process with 3 repeats;
#   PHASE=measure  issue 15's table on $M48 in one run: bench decode --batch 1,8 all resident (in-process and
#                  through the service), then a 25% cache in-process; the summary last.
source tools/device/setup.sh
T0=$(date +%s); BUDGET=${BUDGET:-240}
now() { echo $(( $(date +%s) - T0 )); }
upto() { local l=$(( BUDGET - $(now) )); echo $(( l < $1 ? l - 2 : $1 )); }
quiet() { grep -av "Warn\|warn(\|_warn_once\|moebus.cublas" ; }
if [[ $PHASE == final ]]; then  # call C, alone on a fresh machine: the merged tree's last checks
  (timeout 100 python3 -m moebus.cli init-model $M48 --preset a3b --layers 48 --experts 32 > $OUT/init48.log 2>&1) &
  timeout 40 python3 -m moebus.cli init-model /tmp/lead-m4 --preset a3b --layers 4 --experts 32 > $OUT/init4.log 2>&1
  for n in 1 2; do  # a worker's start twice: the second must load every kernel from the disk cache
    timeout $(upto 70) python3 -m moebus.cli bench decode --model /tmp/lead-m4 --device cuda --batch 1 --tokens 8 \
      --repeats 1 > $OUT/start$n.txt 2>&1; echo "start $n rc=$? at $(now) s: $(grep -a "gpu0 kernels:" $OUT/start$n.txt | cut -c60-)"
  done
  MOEBUS_TEST_GPU=1 timeout $(upto ${TESTS_S:-150}) python3 -m pytest -q -rfE -p no:cacheprovider \
    ${GPU_TESTS:-tests/cuda/test_attention_decode_tc.py tests/cuda/test_attention.py tests/cuda/test_moe_quant_round.py \
    tests/cuda/test_linear_quant_fp8.py tests/cuda/test_layernorm_held.py tests/cuda/test_split_two_parts.py \
    tests/cuda/test_cache_launch_ahead.py tests/cuda/test_patchify.py} > $OUT/gpu_tests.txt 2>&1
  echo "gpu tests rc=$? at $(now) s"; grep -aE "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.txt | cut -c1-240 | head -12
  timeout $(upto 40) python3 tools/device/graph_check.py /tmp/lead-m4 2>&1 | grep -aE "vs eager|CHECK|Error|same" | head -8
  wait
  echo "== all resident, in-process, 3 repeats, at $(now) s"
  timeout $(upto 100) python3 -m moebus.cli bench decode --model $M48 --device cuda --batch 1,8 --tokens 64 --repeats 3 \
    --no-service 2>&1 | quiet | tee $OUT/resident3.txt | tail -6
  echo "final end at $(now) s"; exit 0
fi
if [[ $PHASE == warm ]]; then
  timeout 40 python3 -m moebus.cli init-model /tmp/lead-m4 --preset a3b --layers 4 --experts 32 > $OUT/init4.log 2>&1
  if [[ $TESTS == 1 ]]; then  # (call A: the tests did not end in 80 s beside the other warm phases)
    MOEBUS_TEST_GPU=1 timeout $(upto 80) python3 -m pytest -q -rfE -p no:cacheprovider \
      tests/cuda/test_attention.py tests/cuda/test_cache_launch_ahead.py tests/cuda/test_gemm.py \
      tests/workers/test_scratch_widened.py tests/workers/test_vision_preload.py > $OUT/gpu_tests.txt 2>&1
    echo "gpu tests rc=$? at $(now) s"; grep -aE "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.txt | cut -c1-240 | head -12
  fi
  # the measure phase's kernels compiled (and the service's start) on the small model, untimed
  timeout $(upto 70) python3 -m moebus.cli bench decode --model /tmp/lead-m4 --device cuda --batch 1,8 --tokens 8 \
    --repeats 1 > $OUT/warm_bench.txt 2>&1; echo "warm bench rc=$? at $(now) s"
  timeout $(upto 40) python3 -m moebus.cli bench decode --model /tmp/lead-m4 --device cuda --batch 1,8 --tokens 8 \
    --repeats 1 --cache-frac 0.25 --no-service >> $OUT/warm_bench.txt 2>&1; echo "warm bench 25% rc=$? at $(now) s"
  timeout $(upto 40) python3 tools/device/graph_check.py /tmp/lead-m4 2>&1 | grep -aE "vs eager|CHECK|Error|same" | head -8
  exit 0
fi
echo "== all resident, b1 and b8, in-process and through the service, at $(now) s"
timeout $(upto ${RESIDENT_S:-150}) python3 -m moebus.cli bench decode --model $M48 --device cuda --batch 1,8 --tokens 64 \
  --repeats 2 2>&1 | quiet | tee $OUT/resident.txt | tail -8
echo "== a 25% cache, b1 and b8, in-process (launched ahead by default now), at $(now) s"
timeout $(upto ${CACHE_S:-80}) python3 -m moebus.cli bench decode --model $M48 --device cuda --batch 1,8 --tokens 64 \
  --repeats 2 --cache-frac 0.25 --no-service 2>&1 | quiet | tee $OUT/cache25.txt | tail -6
echo "== summary at $(now) s"; grep -av "moebus.cublas" $OUT/resident.txt $OUT/cache25.txt | cut -c1-240 | tail -24
