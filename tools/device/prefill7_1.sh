#!/usr/bin/env bash
# One H200, seventh session's first call (~160 s; branch prefill7): issue 19's figures still owed,
# each with its own timeout, in the order of their worth, the call stopping by DEADLINE_S:
#   fidelity of the six tiny models at bf16 KV, fused vs materialised attention (tc_fidelity.py,
#   one process, 4 CPU threads, in the background from the start);
#   the cold image request's first token (`bench vision-cycle --device cuda`, so400m over a 2-layer
#   A3B-shaped LM, two cold starts: the first pays first-use costs, the second is measured) while the
#   48 x 32 model is written;
#   prefill 2048 with a cache of 25% of the experts (`bench prefill --cache-frac 0.25`);
#   8 streams beside an 8k prefill, max_prefill_tokens_beside_decode unset (`bench decode
#   --beside-prefill 8192`), if the call's time allows.
# Batch-64 decode is left to the second call, which times it with and without the change of this
# branch in one run. Logs under $OUT.
source tools/device/setup.sh
set -o pipefail
M=/tmp/m48; V=/tmp/vis; DEADLINE_S=${DEADLINE_S:-165}; T0=$(date +%s)
now() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( DEADLINE_S - $(now) )); }
(timeout 90 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $OUT/init48.log 2>&1
 echo "init48 rc=$? done at $(now) s" >> $OUT/init48.log) &
INIT=$!
(OMP_NUM_THREADS=4 timeout 150 python3 tools/device/tc_fidelity.py /tmp/fid split/split/bf16,split/split/bf16/mat 2>&1 \
   | grep -a -v "Warn\|Loading\|warn(" > $OUT/fidelity.txt; echo "fidelity rc=$? done at $(now) s" >> $OUT/fidelity.txt) &
FID=$!
timeout 40 python3 -m moebus.cli init-model $V --preset a3b --layers 2 --experts 16 --vision siglip > $OUT/init_v.log 2>&1
echo "== vision-cycle, cold image (2 cold starts, the second measured) at $(now) s"
timeout 100 python3 -m moebus.cli bench vision-cycle --device cuda --model $V --idle-s 1 --repeats 2 --text-streams 2 \
  --skip-resident --cold-starts 2 --timeout-s 90 > $OUT/cycle.log 2>&1
echo "rc=$?"; grep -vE "^\{" $OUT/cycle.log | grep -aE "cold image|warm image|first token|start|encode" | cut -c1-200 | head -12
wait $INIT; tail -1 $OUT/init48.log
echo "== prefill 2048, cache of 25% of the experts at $(now) s"
timeout 45 python3 -m moebus.cli bench prefill --model $M --device cuda --tokens 2048 --cache-frac 0.25 --repeats 2 \
  2>&1 | grep -av Warn | tee $OUT/prefill25.txt | tail -3
if [ "$(left)" -gt 45 ]; then
  echo "== beside 8192, cap unset, at $(now) s (timeout $(( $(left) - 5 )) s)"
  timeout $(( $(left) - 5 )) python3 -m moebus.cli bench decode --model $M --device cuda --batch 1 --tokens 2 --repeats 1 \
    --no-service --beside-prefill 8192 --json 2>$OUT/beside_none.err | tee $OUT/beside_none.json | tail -c 900
  echo "rc=$?"; grep -a "Error\|error" $OUT/beside_none.err | tail -3
else
  echo "== beside 8192: skipped, $(left) s left"
fi
wait $FID; echo "== fidelity at bf16 KV (fused, then materialised)"; grep -a "FIDELITY\|rc=" $OUT/fidelity.txt
grep -a "max|dlogit|" $OUT/fidelity.txt | cut -c1-120
echo "end at $(now) s"
