#!/usr/bin/env bash
# The eleventh session's lead call 1 on integ11 (one H200, one call for three branches: the machines were
# scarce): vl11.sh (the Qwen3-VL tower bytes-in / early copies, the cold cycle), gap11.sh (the LLaVA cold
# image's chunk steps traced), then bench decode on 48 x 32 all resident and at a 25% cache. Each part's
# stdout in $OUT/<part>/stdout.txt; its tail printed. BUDGET: the call's seconds (590).
set +e
source tools/device/setup.sh > /dev/null
T0=$(date +%s); BUDGET=${BUDGET:-590}; O=$OUT; M=/tmp/m48
now() { echo $(( $(date +%s) - T0 )); }
upto() { local l=$(( BUDGET - $(now) )); echo $(( l < $1 ? l - 3 : $1 )); }
mkdir -p $O/vl $O/gap $O/decode
(timeout 150 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > $O/decode/init48.log 2>&1
 echo "init48 rc=$? at $(now) s" >> $O/decode/init48.log) &
OUT=$O/vl TESTS=1 BUDGET=$(( $(upto 215) - 5 )) timeout $(upto 215) bash tools/device/vl11.sh > $O/vl/stdout.txt 2>&1
echo "vl rc=$? at $(now) s" | tee -a $O/vl/stdout.txt; tail -c 4500 $O/vl/stdout.txt
OUT=$O/gap BUDGET=$(( $(upto 150) - 5 )) timeout $(upto 150) bash tools/device/gap11.sh > $O/gap/stdout.txt 2>&1
echo "gap rc=$? at $(now) s" | tee -a $O/gap/stdout.txt; tail -c 4500 $O/gap/stdout.txt
wait; tail -1 $O/decode/init48.log
echo "== decode all resident at $(now) s"
timeout $(upto 110) python3 -m moebus.cli bench decode --model $M --device cuda --batch 1,8 --tokens 64 --repeats 2 \
  --no-service > $O/decode/resident.txt 2>&1; echo "rc=$?"; grep -av "Warn\|warn(" $O/decode/resident.txt | tail -5
echo "== decode 25% cache at $(now) s"
timeout $(upto 90) python3 -m moebus.cli bench decode --model $M --device cuda --batch 1,8 --tokens 32 --repeats 2 \
  --no-service --cache-frac 0.25 > $O/decode/cache25.txt 2>&1; echo "rc=$?"; grep -av "Warn\|warn(" $O/decode/cache25.txt | tail -6
echo "lead11_call1 end at $(now) s"
