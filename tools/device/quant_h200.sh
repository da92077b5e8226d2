# One H200: quantized experts (issue 16). Sections, each within one 10-minute call when run alone:
#   tools/device/quant_h200.sh [tests] [resident] [cache] [quality]   (none: all four)
# tests     the fp8 / int4 GEMV kernel tests and the quantized cuda path on the GPU
# resident  bench decode, batch 1 and 8, bf16 / fp8 / int4 experts, every expert resident
# cache     the same with a cache of one fixed size: 25% of the bf16 experts' MiB for every dtype
# quality   bench quality (top-1 agreement, mean KL vs bf16 over 256 decode steps) on the demo model
# vision    (not in the default set: a call of its own) bench vision-cycle with bf16 and fp8 experts, the
#           resident experts through a lazy-vision cycle, as tools/device/vision_h200.sh
# The model: Qwen3-30B-A3B's shapes, $LAYERS layers (default 16) x 32 experts (the issue's target is
# 48 x 32; per-layer costs are the same, and 16 layers keep each section inside one call).
source tools/device/setup.sh
set -o pipefail
LAYERS=${LAYERS:-16}
MODEL=/tmp/a3b-${LAYERS}x32
SECTIONS=${*:-tests resident cache quality}
model() {
  [ -f $MODEL/config.json ] || timeout 300 python3 -m moebus.cli init-model $MODEL --preset a3b --layers $LAYERS \
    --experts 32 >/dev/null
}
decode() {  # decode DTYPE [--cache-frac F]: in-process tok/s, JSON lines
  MOEBUS_EXPERTS__DTYPE=$1 timeout 280 python3 -m moebus.cli bench decode --model $MODEL --device cuda --batch 1,8 \
    --tokens 64 --repeats 3 --no-service --json --experts-dtype "$@"
}
for section in $SECTIONS; do
  echo "== $section"; date
  case $section in
  tests)
    MOEBUS_TEST_GPU=1 timeout 400 python3 -m pytest -q -x -p no:cacheprovider tests/cuda/test_moe_quant.py \
      tests/cuda/test_quant_e2e.py tests/cuda/test_moe.py 2>&1 | tail -8 | tee $OUT/quant_gpu_tests.txt ;;
  resident)
    model
    for dtype in bf16 fp8 int4; do decode $dtype | tee -a $OUT/decode_resident.jsonl; done ;;
  cache)
    model
    # the same MiB for every dtype: bf16's 25%, as a share of each dtype's (smaller) experts
    for dtype in bf16 fp8 int4; do
      frac=$(python3 -c "
from moebus.common.checkpoint import Checkpoint; from moebus.common.quant_layout import expert_layout
c = Checkpoint('$MODEL').config; d, i = c.hidden_size, c.moe_intermediate_size
layout = expert_layout('$dtype', d, i); ratio = 1 if layout is None else 3 * d * i * 2 / layout.blob_bytes
print(min(1.0, 0.25 * ratio))")
      decode $dtype --cache-frac $frac | tee -a $OUT/decode_cache.jsonl
    done ;;
  quality)
    timeout 500 python3 -m moebus.cli bench quality --device cuda --steps 256 --prompts 8 --json \
      | tee $OUT/quality_demo_cuda.jsonl ;;
  vision)
    [ -f /tmp/a3b-vision/config.json ] || timeout 200 python3 -m moebus.cli init-model /tmp/a3b-vision --preset a3b \
      --layers 2 --experts 16 --vision siglip >/dev/null
    for dtype in bf16 fp8; do  # the served workers read the dtype from the environment
      MOEBUS_EXPERTS__DTYPE=$dtype timeout 190 python3 -m moebus.cli bench vision-cycle --device cuda \
        --model /tmp/a3b-vision --idle-s 3 --repeats 2 --text-streams 2 --text-tokens 64 --timeout-s 180 2>&1 \
        | grep -v "^\s*$" | tail -25 | tee $OUT/vision_cycle_$dtype.txt
    done ;;
  esac
done
python3 - <<'PY' "$OUT"
import json, sys, pathlib
for name in ("decode_resident", "decode_cache"):
    path = pathlib.Path(sys.argv[1]) / f"{name}.jsonl"
    if not path.is_file():
        continue
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    base = {r["batch"]: r["tok_s"] for r in rows if r["experts_dtype"] == "bf16"}
    for r in rows:
        print(f"{name:16} {r['experts_dtype']:5} batch {r['batch']}: {r['tok_s']:8.1f} tok/s "
              f"({r['tok_s'] / base.get(r['batch'], float('nan')):.2f}x bf16)  cache {r['expert_cache_mib']:.0f} MiB "
              f"hit rate {r['hit_rate']:.3f}")
PY
date
