#!/usr/bin/env bash
# One H200, issue 20's parts that need a GPU. Run from the repository root with .whl/ carried (see
# README.md here), one part per call (each fits the 10-minute limit):
#
#   bash tools/device/firstrun_h200.sh start   # item 6: a healthy cuda start logs no ERROR; item 2: a budget
#   bash tools/device/firstrun_h200.sh bench   # item 3: bench vision-cycle --device cuda --gpu-memory-mib 8192
#
# `start` serves the embedded demo model on cuda (twice: the whole GPU, then gpu_memory_mib 4096),
# answers a text chat and the README's image example (which starts the vision worker, a second cuda
# start), and prints `grep -c ERROR` of each log (expected: 0) and /v1/vram within the budget.
# `bench` makes an 8-layer Qwen3-30B-A3B-shaped LLaVA (128 experts a layer, SigLIP-so400m's tower)
# and runs the lazy-vision cycle with an 8 GiB budget: expected (b) == (d) > (a) ≈ (c), real MiB,
# and the text streams' largest gap through the cold start <= 2x their median.
# Logs and outputs go to $OUT (the device tool fetches them).
set -u
source tools/device/setup.sh
OUT=${OUT:-/tmp/firstrun-out}
mkdir -p "$OUT"

serve_and_ask() {  # $1: a name, $2: a JSON settings file
  local name=$1 config=$2 log=$OUT/serve_$1.log
  python3 -m moebus.cli serve --device cuda --config "$config" > "$log" 2>&1 &
  local pid=$!
  python3 - "$name" <<'EOF'
import base64, io, json, sys, time

import requests
from PIL import Image

base = "http://127.0.0.1:8000"
deadline = time.monotonic() + 400
while True:
    try:
        if requests.get(base + "/health", timeout=2).status_code == 200:
            break
    except requests.RequestException:
        pass
    if time.monotonic() > deadline:
        sys.exit("not healthy in 400 s")
    time.sleep(1)
print(sys.argv[1], "healthy:", requests.get(base + "/health", timeout=10).json())
chat = {"model": "moebus", "max_tokens": 16, "messages": [{"role": "user", "content": "Hello"}]}
r = requests.post(base + "/v1/chat/completions", json=chat, timeout=120)
print("text chat:", r.status_code, r.json()["usage"] if r.ok else r.text)
buf = io.BytesIO()
Image.new("RGB", (64, 64), (200, 120, 40)).save(buf, "PNG")
url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
image = {"model": "moebus", "max_tokens": 32, "messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]}]}
started = time.monotonic()
r = requests.post(base + "/v1/chat/completions", json=image, timeout=300)
print(f"image chat: {r.status_code} in {time.monotonic() - started:.1f} s", r.json()["usage"] if r.ok else r.text)
print("vram:", requests.get(base + "/v1/vram", timeout=30).json()["line"])
info = requests.get(base + "/v1/cache", timeout=30).json()
print("vision placement:", json.dumps(info["vision"]["placement"]))
EOF
  kill -TERM $pid; wait $pid
  echo "$name: exit $?; grep -c ERROR $log: $(grep -c ERROR "$log")"
  grep ERROR "$log" | head -5
  grep -E "budget of|step scratch measured|ready:|placed on" "$log" | head -8
}

case "${1:-start}" in
start)
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
  echo '{}' > /tmp/whole.json
  echo '{"gpu_memory_mib": [4096]}' > /tmp/budget.json
  serve_and_ask whole /tmp/whole.json
  serve_and_ask budget /tmp/budget.json
  ;;
bench)
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
  M=/tmp/a3b-8x128-vision
  t0=$SECONDS
  python3 -m moebus.cli init-model $M --preset a3b --layers 8 --vision siglip > /dev/null || exit 1
  echo "init-model: $((SECONDS - t0)) s"; du -sh $M
  timeout 500 python3 -m moebus.cli bench vision-cycle --device cuda --model $M --gpu-memory-mib 8192 \
    --idle-s 3 --repeats 3 --text-streams 2 --text-tokens 64 --timeout-s 400 2>&1 | tee "$OUT/bench.log" \
    | grep -v "^\s*$" | grep -v "^{" | tail -40
  echo "rc=${PIPESTATUS[0]}"
  ;;
*) echo "usage: $0 start|bench"; exit 2 ;;
esac
