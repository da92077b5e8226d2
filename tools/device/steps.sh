# source tools/device/steps.sh: a branch script's timed steps within $BUDGET s from $T0 (decode14.sh,
# decode15.sh); each step's output goes to $OUT/NAME.txt
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
at() { echo "$(( $(date +%s) - T0 )) s"; }
quiet() { grep -vE "Warn|warn\(" ; }
step() {  # NAME SECONDS_NEEDED SECONDS_AT_MOST COMMAND...: into $OUT/NAME.txt, its tail to stdout
  local name=$1 need=$2 most=$3 limit; shift 3
  [ $(left) -lt $need ] && { echo "== $name: skipped, $(left) s left"; return; }
  limit=$(( $(left) - 2 )); [ $limit -gt $most ] && limit=$most
  echo "== $name at $(at) (at most $limit s)"
  timeout $limit "$@" 2>&1 | quiet > $OUT/$name.txt
  echo "   rc ${PIPESTATUS[0]} at $(at)"; grep -vE "^\s*$" $OUT/$name.txt | tail -${SHOW:-12} | cut -c1-150
}
