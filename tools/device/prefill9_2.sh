#!/usr/bin/env bash
# One H200 (~100 s wall with the 48 x 32 model to write; not yet run), branch prefill9, for the merged
# tree's call: what prefill9_1.sh did not cover.
#   check    prefill_cache_check.py: a 2048-token prompt then 8 decode steps through a 25% cache against
#            all resident (tokens equal, logprobs bit for bit), the default copy mode;
#   ab       prefill9_ab.py: the modes all and slot at 2048 and a 25% cache (the victims as of 73d9c3b:
#            the policy's weakest among the released slots), 2 rounds of 3;
#   bench    moebus bench prefill --tokens 2048 --cache-frac 0.25 (the figure, its own process).
# Logs under $OUT.
source tools/device/setup.sh
set -o pipefail
M=/tmp/m48; BUDGET=${BUDGET:-150}; T0=$(date +%s)
now() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(now) )); }
[ -f $M/generation_config.json ] || timeout 100 python3 -m moebus.cli init-model $M --preset a3b --layers 48 \
  --experts 32 > $OUT/init48.log 2>&1
echo "== prefill_cache_check 2048 at 0.25, at $(now) s"
timeout $(( $(left) / 2 )) python3 tools/device/prefill_cache_check.py $M 2048 0.25 2>&1 | grep -av "Warn\|warn(" \
  | tee $OUT/check.txt | tail -4
echo "== modes all and slot, at $(now) s"
timeout $(( $(left) - 40 )) python3 tools/device/prefill9_ab.py $M 2048 3 2 0.25 all,slot 2>&1 \
  | grep -av "Warn\|warn(" > $OUT/ab.txt
grep -av "^ *[0-9]" $OUT/ab.txt | head -24
if (( $(left) > 30 )); then
  echo "== bench prefill, at $(now) s"
  timeout $(( $(left) - 2 )) python3 -m moebus.cli bench prefill --model $M --device cuda --tokens 2048 \
    --cache-frac 0.25 --repeats 5 2>&1 | grep -av "Warn\|warn(" | tail -4
fi
echo "end at $(now) s"
