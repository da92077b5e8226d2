#!/usr/bin/env bash
# One H200 (twenty-fifth session), call C, three parts in turn (the GPU to one at a time):
#   1. route_end's WIDE path on by default (its second form: 6.5 against route_tail's 13.8 us under Nsight Compute at
#      128 experts, call A): lead20.sh's sweep on a 16 x 128 A3B (quant25_plan.json: WIDE and route_tail alternating,
#      int4 + fp8 and fp8 + fp8, batch 1, all resident) -> summary.txt, table.txt;
#   2. the admissions within the link's room (MOEBUS_ADMISSION_PEAK 2, the default since call B, against 0) in the
#      steady decode at a 25% cache of the same model, alternating, batch 1 and 8 (call B on the 8 x 128: b1 170 / 181
#      tok/s, b8 1006 / 1012, one run each);
#   3. the rope attention's fidelity on trained heads of 128 (quality23.py on .peer/qtrain128: carry .peer), where
#      time is left.
#   BUDGET=570 bash tools/device/lead25.sh
source tools/device/setup.sh
FINAL=$OUT; T0=$(date +%s); BUDGET=${BUDGET:-570}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
OUT=/tmp/l25 M48=/tmp/m16x128 LAYERS=16 EXPERTS=128 NO_NCU=1 PLAN=quant25_plan.json BUDGET=${SWEEP_S:-230} \
  bash tools/device/lead20.sh 2>&1 | grep -E "rc |b1 |route_end v0|route_tail v0" | cut -c1-160
cp /tmp/l25/summary.txt /tmp/l25/table.txt $FINAL/ 2>/dev/null
grep -E "route_end v0|route_tail v0|^-- " /tmp/l25/table.txt | cut -c1-120
echo "== sweep done at $(( $(date +%s) - T0 )) s"
for peak in ${PEAKS:-2 0 2 0}; do
  [ $(left) -lt 60 ] && { echo "peak $peak: not run, $(left) s left"; continue; }
  MOEBUS_ADMISSION_PEAK=$peak timeout 70 python3 -m moebus.cli bench decode --model /tmp/m16x128 --device cuda \
    --cache-frac 0.25 --batch 1,8 --tokens 64 --repeats 2 --no-service 2>&1 | grep -E "^ +[0-9]+ +[0-9.]+ " \
    | awk -v p=$peak '{print "peak " p ": batch " $1 ", " $2 " tok/s, " $3 " ms a step, hit rate " $5 ", " $6 " GB/s"}'
done | tee $FINAL/peak.txt
echo "== decode done at $(( $(date +%s) - T0 )) s"
if [ -d .peer/qtrain128 ] && [ $(left) -gt 100 ]; then
  timeout $(( $(left) - 5 )) python3 tools/device/quality23.py .peer/qtrain128 .peer/qtrain128/held_out_texts.json 4 128 \
    > $FINAL/quality23.txt 2>&1
  echo "quality23 rc=$?"; grep -vE "Warn|warn\(" $FINAL/quality23.txt | tail -12 | cut -c1-200
fi
echo "== lead25 done at $(( $(date +%s) - T0 )) s"
