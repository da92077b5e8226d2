#!/usr/bin/env bash
# The seventh session's owed figures (its device time ran out), as the branches' own scripts, in two
# calls of <= ~560 s each; PART picks one. Each script's logs under $OUT/<name>; its last lines here.
#   PART=1: settle  2048 tokens through a 25% cache: prefill_cache_check.py (bit for bit vs all resident,
#                   the prefill's time) and `bench prefill --cache-frac 0.25` in one call (issue 19: the
#                   two measured 5,984 and 3,457 tok/s on different machines)
#           quant   LAYERS=24 SECTIONS=decode quant7_call.sh (issue 16: the 24-layer ratios, ~150 s)
#           beside  SECTIONS=beside CAPS=none prefill7_2.sh (issue 19: 8 streams beside an 8k prefill)
#   PART=2: vlcycle vltower7_cycle.sh (issue 18: Qwen3-VL's cold image and four rows, ~200 s)
#           gap     MARGINS=0 gap7_cycle.sh (issue 20: the gaps through a cold start, ~135 s)
#           tower   vltower7.sh (issue 18: the tower after its last unmeasured changes, ~70 s)
source tools/device/setup.sh
set -o pipefail
T0=$(date +%s); ROOT_OUT=$OUT
now() { echo $(( $(date +%s) - T0 )); }
part() {  # name limit_s command...: one script in its own folder, cut at its limit
  local name=$1 limit=$2; shift 2
  mkdir -p $ROOT_OUT/$name
  echo "=== $name at $(now) s"
  OUT=$ROOT_OUT/$name timeout $limit "$@" > $ROOT_OUT/$name/out.txt 2>&1
  echo "rc=$?"; grep -av "Warn\|warn(" $ROOT_OUT/$name/out.txt | tail -${TAIL:-14}
}
settle() {
  local M=/tmp/m48
  [ -d $M ] || timeout 90 python3 -m moebus.cli init-model $M --preset a3b --layers 48 --experts 32 > /dev/null 2>&1
  (cd tools/device && timeout 90 python3 prefill_cache_check.py $M 2048 0.25)
  timeout 60 python3 -m moebus.cli bench prefill --model $M --device cuda --tokens 2048 --cache-frac 0.25 --repeats 2
}
if [ "${PART:-1}" = 1 ]; then
  export -f settle; part settle 170 bash -c settle
  LAYERS=24 SECTIONS=decode part quant 170 bash tools/device/quant7_call.sh
  SECTIONS=beside CAPS=none part beside 210 bash tools/device/prefill7_2.sh
else
  part vlcycle 230 bash tools/device/vltower7_cycle.sh
  MARGINS=0 part gap 170 bash tools/device/gap7_cycle.sh
  part tower 90 bash tools/device/vltower7.sh
fi
echo "end at $(now) s"
