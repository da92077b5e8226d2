#!/usr/bin/env bash
# One H200 (~4 min with every section; SECTIONS picks some): what branch prefill7 could not measure
# in its own allowance (its one call, prefill7_1.sh, measured fidelity, the 25% cache and the cold
# image), for the lead's merged-tree call:
#   tests   the GPU tests of the decode tiles (tests/cuda/test_gemm.py's plan tests,
#           tests/cuda/test_prefill_tensor_cores.py: a decode step of 4 sequences in tiles, captured
#           and replayed, against the cpu device), while the 48 x 32 model is written;
#   decode  tools/device/prefill7_decode.py on 48 x 32: batch 32 and 64, experts as GEMVs vs in
#           tiles (vs tiles + dense products on tensor cores) in one process: ms/step, tok/s (issue
#           19: >= 3,000 at batch 64), graph == eager, logprobs against the GEMVs';
#   beside  8 streams beside an 8k prefill (`bench decode --beside-prefill 8192`), once per
#           max_prefill_tokens_beside_decode in CAPS (default "none 128"; unset = 504 tokens a chunk
#           beside 8 decode rows, so 512 would be the same).
# Logs under $OUT.
source tools/device/setup.sh
set -o pipefail
M=/tmp/m48; SECTIONS=${SECTIONS:-"tests decode beside"}; CAPS=${CAPS:-"none 128"}; T0=$(date +%s)
now() { echo $(( $(date +%s) - T0 )); }
(timeout 90 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $OUT/init48.log 2>&1
 echo "init48 rc=$? done at $(now) s" >> $OUT/init48.log) &
INIT=$!
if [[ $SECTIONS == *tests* ]]; then
  echo "== GPU tests at $(now) s"
  MOEBUS_TEST_GPU=1 timeout 150 python3 -m pytest -v -rfE -p no:cacheprovider tests/cuda/test_prefill_tensor_cores.py \
    tests/cuda/test_gemm.py -k "tensor_cores or planned or placement or spare or many_sequences" > $OUT/gpu_tests.txt 2>&1
  echo "rc=$? passed $(grep -c ' PASSED' $OUT/gpu_tests.txt) failed $(grep -c ' FAILED' $OUT/gpu_tests.txt)"
  grep -E "^(FAILED|ERROR) " $OUT/gpu_tests.txt | cut -c1-220 | head -8
fi
wait $INIT; tail -1 $OUT/init48.log
if [[ $SECTIONS == *decode* ]]; then
  echo "== decode of 32 and 64 sequences, GEMVs vs tiles, at $(now) s"
  timeout 200 python3 tools/device/prefill7_decode.py $M 32,64 16 2>&1 | grep -av "Warn\|warn(" | tee $OUT/decode.txt | tail -8
fi
if [[ $SECTIONS == *beside* ]]; then
  for cap in $CAPS; do
    echo "== beside 8192, cap $cap, at $(now) s"
    if [ "$cap" = none ]; then unset MOEBUS_MAX_PREFILL_TOKENS_BESIDE_DECODE
    else export MOEBUS_MAX_PREFILL_TOKENS_BESIDE_DECODE=$cap; fi
    timeout 200 python3 -m moebus.cli bench decode --model $M --device cuda --batch 1 --tokens 2 --repeats 1 \
      --no-service --beside-prefill 8192 --json 2>$OUT/beside_$cap.err > $OUT/beside_$cap.json
    echo "rc=$?"; grep -a "Error" $OUT/beside_$cap.err | tail -2
  done
  unset MOEBUS_MAX_PREFILL_TOKENS_BESIDE_DECODE
  python3 - $OUT $CAPS <<'PY'
import json, sys
out, caps = sys.argv[1], sys.argv[2:]
cols = ("gap_before_ms", "gap_during_ms", "gap_during_mean_ms", "gap_during_max_ms", "gap_ratio", "first_token_s",
        "prefill_tok_s", "during_steps")
print(f"{'cap':>5} " + " ".join(f"{c:>18}" for c in cols))
for cap in caps:
    try:
        row = json.loads(open(f"{out}/beside_{cap}.json").read().splitlines()[-1])
    except (OSError, IndexError, ValueError):
        print(f"{cap:>5}  no figures (see beside_{cap}.err)")
        continue
    print(f"{cap:>5} " + " ".join(f"{row.get(f'beside8192_{c}', '-')!s:>18}" for c in cols))
PY
fi
echo "end at $(now) s"
