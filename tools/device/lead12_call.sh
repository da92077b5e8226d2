#!/usr/bin/env bash
# One device call for several branches (twelfth session: machines are scarce, each start costs 60-340 s).
# Each branch's tree is at .gpu/<name> (carried); its script tools/device/<name>$S.sh (S=12 unless set: S=13 for
# the thirteenth session's scripts) runs twice:
#   PHASE=warm    all branches side by side (init-model, kernel compiles; no timing), at most WARM_S s;
#   PHASE=measure one branch after another, each within its own seconds.
# PARTS="decode:150 miss:110 ...": name:seconds of its measure phase, in order. A 48 x 32 a3b model is made
# at /tmp/m48 during the warm phase (M48 is exported to every script). Each part's $OUT is packed into
# $OUT/<name>.tgz (the tool returns at most 8 files) and the tail of its stdout printed. Parts whose .gpu/<name> are
# symlinks to one tree (ONE_TREE=<name>: made here for every part without a tree of its own) run from its physical path (cd -P): numba's disk cache is keyed by the source file's path,
# so they share one kernel cache (seventeenth session: separate copies made a part compile everything again).
set +e
T0=$(date +%s); S=${S:-12}; BUDGET=${BUDGET:-590}; WARM_S=${WARM_S:-150}; O=$OUT
now() { echo $(( $(date +%s) - T0 )); }
first=${PARTS%%:*}
for p in $PARTS; do n=${p%%:*}; [ -e .gpu/$n ] || ln -s ${ONE_TREE:?"no .gpu/$n: carry it, or set ONE_TREE"} .gpu/$n; done
(cd -P .gpu/$first && ln -sfn ../../.whl .whl && ln -sfn ../../.peer .peer && source tools/device/setup.sh) || exit 1
export MOEBUS_SITE_READY=1 M48=/tmp/m48
for p in $PARTS; do n=${p%%:*}; (cd -P .gpu/$n && ln -sfn ../../.whl .whl && ln -sfn ../../.peer .peer); mkdir -p $O/$n; done
( cd -P .gpu/$first && source tools/device/setup.sh && [ -d $M48 ] || timeout $WARM_S python3 -m moebus.cli init-model $M48 \
    --preset a3b --layers 48 --experts 32 > $O/init48.log 2>&1; echo "init48 rc=$? at $(now) s" >> $O/init48.log ) &
for p in $PARTS; do n=${p%%:*}
  ( cd -P .gpu/$n && PHASE=warm OUT=$O/$n BUDGET=$WARM_S timeout $WARM_S bash tools/device/${n}$S.sh > $O/$n/warm.txt 2>&1
    echo "$n warm rc=$? at $(now) s" >> $O/$n/warm.txt ) &
done
wait
tail -1 $O/init48.log; for p in $PARTS; do tail -2 $O/${p%%:*}/warm.txt; done
for p in $PARTS; do n=${p%%:*}; s=${p##*:}; left=$(( BUDGET - $(now) - 8 )); [ $s -gt $left ] && s=$left
  [ $s -lt 20 ] && { echo "== $n skipped: $left s left"; continue; }
  echo "== $n measure, $s s, at $(now) s"
  ( cd -P .gpu/$n && PHASE=measure OUT=$O/$n BUDGET=$(( s - 4 )) timeout $s bash tools/device/${n}$S.sh > $O/$n/stdout.txt 2>&1
    echo "$n rc=$? at $(now) s" >> $O/$n/stdout.txt )
  tail -c ${TAIL:-2600} $O/$n/stdout.txt
done
for p in $PARTS; do n=${p%%:*}; (cd $O && tar -czf $n.tgz $n && rm -rf $n); done
echo "lead12_call end at $(now) s"
