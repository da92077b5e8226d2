#!/usr/bin/env bash
# One H200, issue 15 item 3 (the service path at in-process speed): the launch-ahead test on the GPU,
# then `bench decode` in-process and through the service (look-ahead and launch-ahead on) at batch 1
# and 8, then the service with both off, on `init-model --preset a3b --layers N --experts 32`
# (N = $1, default 24). A summary table comes last; logs and JSON under $OUT.
source tools/device/setup.sh
set -o pipefail
export SVC_MODEL=/tmp/svc_m${1:-24} SVC_LAYERS=${1:-24}
start=$SECONDS
stamp() { echo "== $1 ($((SECONDS - start)) s)"; }
stamp "GPU test"
MOEBUS_TEST_GPU=1 timeout 60 python3 -m pytest -q -rf -p no:cacheprovider tests/cuda/test_launch_ahead.py 2>&1 \
  | tee $OUT/gpu_test.txt | tail -3
stamp "init-model"
[ -d $SVC_MODEL ] || python3 -m moebus.cli init-model $SVC_MODEL --preset a3b --layers $SVC_LAYERS --experts 32 2>&1 | tail -1
stamp "bench decode, look-ahead and launch-ahead on"
timeout 100 python3 -m moebus.cli bench decode --model $SVC_MODEL --device cuda --batch 1,8 --tokens 64 --repeats 2 \
  --json 2>&1 | tee $OUT/decode_on.txt | grep '^{' > $OUT/decode_on.json
stamp "service, look-ahead and launch-ahead off"
if [ $((SECONDS - start)) -lt 95 ]; then
MOEBUS_BROKER__LOOKAHEAD=false MOEBUS_LAUNCH_AHEAD=false timeout 45 python3 - <<'EOF' 2>&1 | tee $OUT/service_off.txt | grep '^{' > $OUT/service_off.json
import json, os
from moebus.bench.decode import _through_service
prompt = [(7 * i + 3) % 200 + 10 for i in range(32)]
for batch, s in _through_service(os.environ["SVC_MODEL"], "cuda", prompt, 64, 2, [1, 8]).items():
    print(json.dumps({"batch": batch, **s}))
EOF
fi
stamp "done"
python3 - <<'EOF'
import json, os
out = os.environ["OUT"]
def rows(name):
    try:
        return [json.loads(l) for l in open(f"{out}/{name}") if l.strip()]
    except OSError:
        return []
on, off = rows("decode_on.json"), {r["batch"]: r for r in rows("service_off.json")}
print(f"model: {os.environ['SVC_LAYERS']} layers x 32 experts (a3b shapes), cuda graphs")
print("| batch | in-process tok/s (ms/step) | service tok/s | share | step ms: broker / stage / hop | off: service tok/s | off: share | off: broker / stage / hop |")
print("|---|---|---|---|---|---|---|---|")
for r in on:
    b = r["batch"]
    s = lambda k: r.get(f"{k}")
    o = off.get(b, {})
    off_cols = (f"{o['tok_s']:.1f} | {o['tok_s'] / r['tok_s']:.3f} | {o['broker_step_ms']:.2f} / {o['worker_step_ms']:.2f} / "
                f"{o['broker_step_ms'] - o['worker_step_ms']:.3f}") if o else "- | - | -"
    print(f"| {b} | {r['tok_s']:.1f} ({r['ms_per_step']:.2f}) | {s(f'service_batch{b}_tok_s'):.1f} | "
          f"{s(f'service_batch{b}_share_of_in_process'):.3f} | {s(f'service_batch{b}_step_ms'):.2f} / "
          f"{s(f'worker_batch{b}_step_ms'):.2f} / {s(f'broker_batch{b}_added_ms_per_step'):.3f} | {off_cols} |")
EOF
