#!/usr/bin/env bash
# One H200, one call (~8 min): the merged tree of 2026-12-01's third session. GPU kernel tests
# (every kernel family, the masked sampler, the quantized GEMVs, M-RoPE, the tensor-core paths),
# decode with bf16 / fp8 / int4 experts all resident, Qwen3-VL-MoE fidelity on cuda + the a3b
# tower's encode, masks in captured graphs. Logs under $OUT.
source tools/device/setup.sh
set -o pipefail
echo "== GPU tests"; date
MOEBUS_TEST_GPU=1 timeout 190 python3 -m pytest -q -rf -p no:cacheprovider tests/cuda 2>&1 \
  | tee $OUT/gpu_tests.txt | grep -E "passed|failed|FAILED|Error" | tail -15
echo "== decode, experts bf16/fp8/int4, all resident (8 layers x 32 experts, A3B shapes)"; date
M=/tmp/a3b-8x32
timeout 60 python3 -m moebus.cli init-model $M --preset a3b --layers 8 --experts 32 > /dev/null 2>&1
for dtype in bf16 fp8 int4; do
  MOEBUS_EXPERTS__DTYPE=$dtype timeout 45 python3 -m moebus.cli bench decode --model $M --device cuda --batch 1,8 \
    --tokens 64 --repeats 2 --no-service --json --experts-dtype $dtype 2>/dev/null | grep '^{' | tee -a $OUT/decode.jsonl
done
python3 - "$OUT/decode.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
base = {r["batch"]: r["tok_s"] for r in rows if r.get("experts_dtype") == "bf16"}
for r in rows:
    print(f"{r.get('experts_dtype')} batch {r['batch']}: {r['tok_s']:.1f} tok/s ({r['tok_s'] / base.get(r['batch'], float('nan')):.2f}x bf16)"
          f" cache {r.get('expert_cache_mib', 0):.0f} MiB slots {r.get('expert_slots', '?')}")
PY
rm -rf $M
echo "== Qwen3-VL-MoE on cuda"; date
timeout 110 python3 tools/device/qwen3vl_check.py 2>&1 | grep -v "^\s*$\|Loading weights\|Writing\|Warn" | tee $OUT/qwen3vl.txt | tail -14
echo "== masks in captured graphs"; date
timeout 20 python3 -m moebus.cli init-model /tmp/m4 --preset a3b --layers 4 --experts 32 > /dev/null 2>&1
timeout 45 python3 tools/device/mask_graph_check.py /tmp/m4 2>&1 | grep -v Warn | tee $OUT/mask_graph.txt | tail -6
date
