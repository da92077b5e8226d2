#!/usr/bin/env bash
# Issue 16, nineteenth session: the partial cache with the tensor-core GEMVs on (MOEBUS_QUANT_MMA's default, all) and
# off: `bench decode` at a cache of bf16's 25% MiB on a fresh 48 x 32 a3b model, fp8 experts + fp8 attention (then
# int4 where time is left), batch 1, 64 tokens, 3 repeats (the median of the last two), one process a setting.
# Misses are read from the mapped host store by the same kernels. BUDGET (s) bounds it all; the table last.
source tools/device/setup.sh
T0=$(date +%s); B=${BUDGET:-250}; M=${M48:-/tmp/m48}; OUT=${OUT:-/tmp/quarter19}; mkdir -p $OUT
left() { echo $(( B - ($(date +%s) - T0) )); }
[ -d $M ] || timeout 60 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $OUT/init.log 2>&1
Q=$(python3 -c "from moebus.bench.decode import experts_mib; print(experts_mib('$M', 'bf16') / 4)")
echo "model ready at $(( $(date +%s) - T0 )) s; cache $Q MiB"
for run in ${RUNS:-fp8:all fp8:0 int4:all int4:0}; do
  d=${run%%:*}; mma=${run##*:}
  [ $(left) -lt 40 ] && { echo "$run skipped: $(left) s left"; continue; }
  MOEBUS_QUANT_MMA=$mma timeout $(( $(left) - 3 )) python3 -m moebus.cli bench decode --model $M --device cuda --batch 1 \
    --tokens 64 --repeats 3 --no-service --json --experts-dtype $d --attention-dtype fp8 --cache-mib $Q \
    > $OUT/$d-$mma.txt 2>&1
  echo "$run rc=$? at $(( $(date +%s) - T0 )) s: $(grep -a '"tok_s"' $OUT/$d-$mma.txt | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line[line.index('{'):])
    print(f\"b{r['batch']} {r['tok_s']:.1f} tok/s hit {r.get('hit_rate') or 0:.3f} {r.get('expert_cache_mib') or 0:.0f} MiB\")")"
done
