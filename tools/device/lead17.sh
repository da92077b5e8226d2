#!/usr/bin/env bash
# The lead's part of the seventeenth session's calls (lead12_call.sh with S=17, part "lead").
#   PHASE=warm     (beside the other branches; nothing timed) a 2 x 32 a3b model (/tmp/lead-m2) and bench decode on
#                  it at a partial cache for each experts dtype, batch 1 and 8: compiles what the measure runs.
#   PHASE=measure  issue 16's third target at equal warm-up: `bench decode` at a cache of bf16's 25% MiB on $M48,
#                  one process a dtype (bf16, fp8, int4 with fp8 attention), batch 1 and 8, 64 tokens, 3 repeats
#                  (the first warms the cache, the median of the last two counts: the same for every dtype), then
#                  the ratios to bf16. (The sixteenth session's b1 figures came from runs of 16 tokens, 1 repeat,
#                  in which bf16's hit rate was 0.359 against bench decode's 0.704.)
#                  Then, with the seconds left (CHECK_S of them kept for it): graph == eager on a 4 x 32 model
#                  (/tmp/lead-m4, made in warm), then the GPU tests (GPU_TESTS). LEAD=check: the check alone.
source tools/device/setup.sh
T0=$(date +%s); B=${BUDGET:-150}
now() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( B - $(now) )); }
quiet() { grep -av "Warn\|warn(\|_warn_once\|moebus.cublas" ; }
attention_of() { [[ $1 == bf16 ]] && echo bf16 || echo fp8; }
if [[ $PHASE == warm ]]; then
  timeout 40 python3 -m moebus.cli init-model /tmp/lead-m2 --preset a3b --layers 2 --experts 32 > $OUT/init2.log 2>&1
  echo "init m2 rc=$? at $(now) s"
  timeout 40 python3 -m moebus.cli init-model /tmp/lead-m4 --preset a3b --layers 4 --experts 32 > $OUT/init4.log 2>&1
  echo "init m4 rc=$? at $(now) s"
  for d in int4 bf16 fp8; do  # int4 first: call B's warm ended before it
    [ $(left) -lt 15 ] && break
    timeout $(( $(left) - 3 )) python3 -m moebus.cli bench decode --model /tmp/lead-m2 --device ${DEVICE:-cuda} --batch 1,8 \
      --tokens 4 --repeats 2 --no-service --experts-dtype $d --attention-dtype $(attention_of $d) --cache-frac 0.5 \
      > $OUT/warm_$d.txt 2>&1
    echo "warm $d rc=$? at $(now) s: $(grep -a 'kernels:' $OUT/warm_$d.txt | head -1 | cut -c1-120)"
  done
  exit 0
fi
check() {  # the merged defaults' correctness on the GPU, within the seconds left
  timeout $(( $(left) / 2 )) python3 tools/device/graph_check.py /tmp/lead-m4 2>&1 | grep -aE "vs eager|CHECK|Error|same" | head -8
  MOEBUS_TEST_GPU=1 timeout $(( $(left) - 3 )) python3 -m pytest -q -rfE -p no:cacheprovider ${GPU_TESTS:-\
    tests/cuda/test_routing.py -k early_loads} > $OUT/gpu_tests.txt 2>&1
  echo "gpu tests rc=$?"; grep -aE "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.txt | cut -c1-240 | head -12
}
[[ $LEAD == check ]] && { check; exit 0; }
Q=$(python3 -c "from moebus.bench.decode import experts_mib; print(experts_mib('$M48', 'bf16') / 4)")
echo "== a cache of bf16's 25% MiB ($Q MiB) on $M48, bench decode --tokens 64 --repeats 3, a process a dtype"
for d in ${DTYPES:-bf16 fp8 int4}; do
  [ $(( $(left) - ${CHECK_S:-0} )) -lt 25 ] && { echo "$d skipped: $(left) s left"; continue; }
  timeout $(( $(left) - ${CHECK_S:-0} - 3 )) python3 -m moebus.cli bench decode --model $M48 --device ${DEVICE:-cuda} --batch 1,8 --tokens 64 \
    --repeats 3 --no-service --json --experts-dtype $d --attention-dtype $(attention_of $d) --cache-mib $Q \
    2>&1 | quiet > $OUT/quarter_$d.txt
  echo "$d rc=${PIPESTATUS[0]} at $(now) s"
done
python3 - "$OUT" <<'EOF'
import json, pathlib, sys
rows = {}
for path in sorted(pathlib.Path(sys.argv[1]).glob("quarter_*.txt")):
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"tok_s"' in line:
            r = json.loads(line)
            rows[(path.stem.split("_")[1], r["batch"])] = r
for (dtype, batch), r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    base = rows.get(("bf16", batch))
    ratio = f"{r['tok_s'] / base['tok_s']:.2f}x" if base else "-"
    print(f"{dtype:5s} b{batch} {r['tok_s']:8.1f} tok/s {ratio:>6s} bf16  hit {r.get('hit_rate') or 0:.3f}  "
          f"slots {r.get('cache_frac') or 0:.2f}  {r.get('expert_cache_mib') or 0:.0f} MiB")
EOF
[ $(left) -gt 20 ] && check
echo "lead end at $(now) s"
