#!/usr/bin/env bash
# One H200, the ninth session's merged tree, second call (~330 s wall): the cold-image cycles.
#   gap    gap9_cycle.sh: the 8 x 128 LLaVA (so400m) under 8 GiB, the chunk that spans steps on (rows
#          a-d, gaps by phase) and off (issue 20's gap target);
#   vl     the Qwen3-VL a3b cold image and four rows (vltower9.sh's cycle part; issue 18);
#   quant  quant9_call.sh with the short plan, if time is left (issue 16).
source tools/device/setup.sh
set -o pipefail
T0=$(date +%s); ROOT_OUT=$OUT; BUDGET=${BUDGET:-330}
now() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(now) )); }
part() {  # name limit_s command...: one script in its own folder, cut at its limit
  local name=$1 limit=$2; shift 2
  mkdir -p $ROOT_OUT/$name
  echo "=== $name at $(now) s (limit $limit s)"
  OUT=$ROOT_OUT/$name timeout $limit "$@" > $ROOT_OUT/$name/out.txt 2>&1
  echo "rc=$?"; grep -av "Warn\|warn(" $ROOT_OUT/$name/out.txt | tail -${TAIL:-30} | cut -c1-230
}
Q=/tmp/a3b-qwen3vl-4
( timeout 90 python3 -m moebus.cli init-model $Q --arch qwen3_vl_moe --preset a3b --layers 4 > $ROOT_OUT/initq.log 2>&1 ) &
part gap 190 bash tools/device/gap9_cycle.sh
wait
L=$(( $(left) > 130 ? 130 : $(left) ))
if (( L > 60 )); then
  mkdir -p $ROOT_OUT/vl
  echo "=== vl cycle at $(now) s (limit $L s)"
  timeout $L python3 -m moebus.cli bench vision-cycle --device cuda --model $Q --gpu-memory-mib 8192 -v \
    --idle-s 1 --repeats 2 --image-px 1024 --text-streams 2 --cold-starts 2 --timeout-s 120 > $ROOT_OUT/vl/cycle.log 2>&1
  echo "rc=$?"
  grep -vE "^\{" $ROOT_OUT/vl/cycle.log | grep -E "^\(|^  |cold image|text streams|warm image|target|not checked" | cut -c1-230
fi
if (( $(left) > 120 )); then PLAN=quant9_plan_short.json part quant $(( $(left) - 5 )) bash tools/device/quant9_call.sh; fi
echo "end at $(now) s"
