#!/usr/bin/env bash
# One H200 call for Qwen3-VL-MoE (issue 18), ~6 min: (1) fidelity on cuda vs transformers on a tiny
# checkpoint transformers wrote (1 image, 2 images of different sizes, text only); (2) the
# Qwen3-VL-30B-A3B tower's warm encode of a 1024x768 image; (3) `bench vision-cycle` on an
# A3B-shaped Qwen3-VL-MoE (2 layers x 16 experts, the full a3b tower): the four-row table and the
# cold-start split. Run from the repository root with .whl carried (see README.md: source setup.sh).
set -u
source tools/device/setup.sh
t0=$SECONDS
timeout 240 python3 tools/device/qwen3vl_check.py 2>&1 | grep -v "^\s*$\|Loading weights\|Writing" | tail -20
echo "check rc=${PIPESTATUS[0]} ($((SECONDS - t0)) s)"
M=/tmp/a3b-qwen3vl
t0=$SECONDS
python3 -m moebus.cli init-model $M --arch qwen3_vl_moe --preset a3b --layers 3 --experts 16 > /dev/null || exit 1
echo "init-model: $((SECONDS - t0)) s"; du -sh $M
timeout 300 python3 -m moebus.cli bench vision-cycle --device cuda --model $M --idle-s 3 --repeats 3 \
  --image-px 1024 --text-streams 2 --text-tokens 64 --timeout-s 280 2>&1 | grep -v "^\s*$" | tail -40
echo "rc=$?"
