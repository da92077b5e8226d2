#!/usr/bin/env bash
# One H200, the ninth session's merged tree, first of two calls (~400 s wall; none of the helpers'
# kernels ran on a GPU after their last edit: four of six got no machine). Sections in order of need,
# each only while BUDGET lasts:
#   tests    GPU tests of what changed: the one-token router tail, in-process launch-ahead, the chunk that
#            spans steps, the copier's per-slot fences, the quantized GEMVs' work shapes; graph == eager
#            on 4 x 32 (with steps launched ahead) beside them;
#   decode   48 x 32 A3B (bf16, bf16 KV): bench decode --batch 1,8 in-process (launch-ahead now on) and
#            with --no-launch-ahead (the eighth session's loop) in the same call; a 25% cache;
#   prefill  bench prefill 2048 / 8192 all resident, 2048 through a 25% cache (per-slot fences);
#   tower    vltower9_encode.py (LEAN): the Qwen3-VL tower's new kernels' tests and warm encode;
#   service  bench decode --batch 1,8 through the service.
source tools/device/setup.sh
set -o pipefail
M=/tmp/m48; M4=/tmp/m4; BUDGET=${BUDGET:-400}; T0=$(date +%s)
now() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(now) )); }
upto() { local l=$(left); echo $(( l < $1 ? l : $1 )); }
quiet() { grep -av "Warn\|warn(" ; }
(timeout 100 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $OUT/init48.log 2>&1
 echo "init48 rc=$? at $(now) s" >> $OUT/init48.log) &
INIT=$!
timeout 40 python3 -m moebus.cli init-model $M4 --preset a3b --layers 4 --experts 32 > $OUT/init4.log 2>&1
echo "== GPU tests and graph == eager (4 x 32) at $(now) s"
timeout 100 python3 tools/device/graph_check.py $M4 > $OUT/graph_check.txt 2>&1 & GC=$!
MOEBUS_TEST_GPU=1 timeout 120 python3 -m pytest -q -rfE -p no:cacheprovider tests/cuda/test_routing.py \
  tests/cuda/test_launch_ahead.py tests/cuda/test_spanning_chunk.py tests/cuda/test_copy_fence.py \
  tests/cuda/test_moe_quant.py tests/cuda/test_linear_quant.py > $OUT/gpu_tests.txt 2>&1
echo "rc=$?"; grep -aE "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.txt | cut -c1-240 | head -14
wait $GC; grep -aE "vs eager|CHECK|Error|same" $OUT/graph_check.txt | head -10
wait $INIT; tail -1 $OUT/init48.log
if (( $(left) > 60 )); then
  echo "== decode 48 x 32, in-process, launch-ahead (default), at $(now) s"
  timeout $(upto 60) python3 -m moebus.cli bench decode --model $M --device cuda --batch 1,8 --tokens 64 --repeats 2 \
    --no-service 2>&1 | quiet | tee $OUT/decode.txt | tail -4
fi
if (( $(left) > 60 )); then
  echo "== decode 48 x 32, in-process, --no-launch-ahead, at $(now) s"
  timeout $(upto 60) python3 -m moebus.cli bench decode --model $M --device cuda --batch 1,8 --tokens 64 --repeats 2 \
    --no-service --no-launch-ahead 2>&1 | quiet | tee $OUT/decode_nla.txt | tail -3
fi
if (( $(left) > 60 )); then
  echo "== prefill 2048 / 8192 all resident, at $(now) s"
  timeout $(upto 60) python3 -m moebus.cli bench prefill --model $M --device cuda --tokens 2048,8192 --repeats 5 \
    2>&1 | quiet | tee $OUT/prefill.txt | tail -4
fi
if (( $(left) > 50 )); then
  echo "== prefill 2048 through a 25% cache, at $(now) s"
  timeout $(upto 50) python3 -m moebus.cli bench prefill --model $M --device cuda --tokens 2048 --repeats 5 \
    --cache-frac 0.25 2>&1 | quiet | tee $OUT/prefill25.txt | tail -3
fi
if (( $(left) > 70 )); then
  echo "== Qwen3-VL tower (LEAN), at $(now) s"
  VLTOWER9_LEAN=1 timeout $(upto 75) python3 tools/device/vltower9_encode.py 10 2>&1 | quiet | tee $OUT/tower.txt \
    | cut -c1-220 | tail -30
fi
if (( $(left) > 50 )); then
  echo "== decode 48 x 32 at a 25% cache, at $(now) s"
  timeout $(upto 50) python3 -m moebus.cli bench decode --model $M --device cuda --batch 1,8 --tokens 32 --repeats 2 \
    --no-service --cache-frac 0.25 2>&1 | quiet | tee $OUT/decode25.txt | tail -3
fi
if (( $(left) > 60 )); then
  echo "== decode through the service, at $(now) s"
  timeout $(( $(left) - 3 )) python3 -m moebus.cli bench decode --model $M --device cuda --batch 1,8 --tokens 64 \
    --repeats 2 2>&1 | quiet | tee $OUT/service.txt | tail -5
fi
echo "end at $(now) s"
