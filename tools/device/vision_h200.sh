#!/usr/bin/env bash
# One H200 call: the lazy-vision cycle on cuda with a SigLIP-so400m-shaped tower (27 layers, hidden 1152,
# patch 14, 384 px) over a small A3B-shaped language model; prints the bench's table and cold-start split.
set -u
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
M=/tmp/a3b-vision
t0=$SECONDS
python3 -m moebus.cli init-model $M --preset a3b --layers 2 --experts 16 --vision siglip > /dev/null || exit 1
echo "init-model: $((SECONDS - t0)) s"; du -sh $M
timeout 330 python3 -m moebus.cli bench vision-cycle --device cuda --model $M --idle-s 3 --repeats 3 \
  --text-streams 2 --text-tokens 64 --timeout-s 300 2>&1 | grep -v "^\s*$" | tail -60
echo "rc=$?"
