#!/usr/bin/env bash
# The eighth session's owed figures (its device time ran out), as the branches' own scripts, in two
# or three calls of <= ~560 s each; PART picks one. Each script's logs under $OUT/<name>; its last lines here.
# Never run as a whole; of what it calls, none ran in the eighth session (each says so in its header).
#   PART=1: vlcycle  vltower7_cycle.sh (issue 18: Qwen3-VL's cold image <= 1.0 s and the four rows, ~150 s)
#           gap      gap8_owed.sh (issue 20: the cycle at the new defaults with row (a), then at 256 MiB
#                    hand-back steps, ~150 s bare)
#           prefetch prefetch6_2.sh (issue 15 item 2: the top-2/3/4 predicted prefetch at a 25% cache on
#                    16 x 32 against none, ~90 s)
#   PART=2: beside   chunk8.sh where it exists (issue 19 item 4: the chunk's attention switched off and on,
#                    then 8 streams beside an 8k prompt), else tc8_beside.sh (caps 8 and 16)
#   PART=3: qprofile PROFILE="bf16:bf16 fp8:fp8 fp8:bf16" quant8_call.sh (issue 16: its 24-layer speed
#                    table again, then GPU time by kernel of the quantized decode steps, ~200 s)
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
if [ "${PART:-1}" = 1 ]; then
  part vlcycle 200 bash tools/device/vltower7_cycle.sh
  part gap 220 bash tools/device/gap8_owed.sh
  part prefetch 120 bash tools/device/prefetch6_2.sh
elif [ "$PART" = 2 ]; then
  if [ -f tools/device/chunk8.sh ]; then part beside 540 bash tools/device/chunk8.sh
  else CAPS="8 16" part beside 540 bash tools/device/tc8_beside.sh; fi
else
  PROFILE="bf16:bf16 fp8:fp8 fp8:bf16" part qprofile 260 bash tools/device/quant8_call.sh
fi
echo "end at $(now) s"
