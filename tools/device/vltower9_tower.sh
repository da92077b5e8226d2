#!/usr/bin/env bash
# One H200, ~45 s of wall (issue 18, branch vltower9): what is left of vltower9.sh when the allowance
# after a failed machine start covers the tower only (the cycle stays owed: vltower9.sh or
# vltower7_cycle.sh). vltower9_encode.py with its three in-process GPU tests (rope_planes bit for
# bit, the fused rotary + attention and its split store against the unfused ops, the image kernel at
# hd 72 with its k8 products); the residual + LayerNorm pass is checked by the tower itself (its
# variant "residual unfused" must differ by exactly 0). Logs under $OUT.
source tools/device/setup.sh
set -o pipefail
echo "== Qwen3-VL tower (a3b shapes, 1024 x 768)"; date
VLTOWER9_LEAN=1 timeout 50 python3 tools/device/vltower9_encode.py 10 2>&1 | grep -av "Warn\|warn(" | tee $OUT/tower.txt | cut -c1-250
echo "tower rc=$?"; date
