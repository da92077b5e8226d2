"""Two GPUs: a Qwen3-30B-A3B-shaped model split over both gives the tokens of the one-GPU run, and
VRAM 1700 600 frees that much on each GPU for a second process. Another program ("ballast") holds
most of each GPU first, so the caches start smaller than their stages' experts, as on a full host.
Usage: split_check.py MODEL_DIR"""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from moebus.client import Client

PROMPTS = [[5, 17, 99, 3, 42, 7], [200, 11, 12, 1000, 7]]
PROBE = """
import sys, time
from numba import cuda
free, total = cuda.current_context().get_memory_info()
ok = True
try:
    buf = cuda.device_array(max(free - (64 << 20), 1), dtype='uint8'); cuda.synchronize()
except Exception:
    ok = False
print(f"{free / 2**20:.0f} {ok}", flush=True)
if len(sys.argv) > 1:
    time.sleep(float(sys.argv[1]))
"""


def probe(gpu: int, hold_s: float = 0.0, keep_gib: float | None = None):
    """A separate process on one GPU: its free MiB after its own context, and whether it could take
    it all. With keep_gib it holds all but that much and stays (the ballast)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu))
    code = PROBE if keep_gib is None else PROBE.replace("free - (64 << 20)", f"free - int({keep_gib} * 2**30)")
    if hold_s:
        return subprocess.Popen([sys.executable, "-c", code, str(hold_s)], env=env, stdout=subprocess.PIPE, text=True)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.split()
    if len(out) != 2:  # not even its own CUDA context fitted
        return 0.0, False
    return float(out[0]), out[1] == "True"


def serve(model: str, gpus: list[int], tmp: Path):
    address = f"ipc://{tmp}/front-{len(gpus)}.sock"
    cfg = {"model": model, "device": "cuda", "gpus": gpus, "segment_mib": 64, "max_batch": 8, "max_context": 1024,
           "broker": {"frontend": address}}
    (tmp / f"cfg{len(gpus)}.json").write_text(json.dumps(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "moebus.cli", "broker", "--config", str(tmp / f"cfg{len(gpus)}.json")])
    client = Client(address, timeout_s=300)
    t = time.time()
    while not client.ping(2.0):
        assert proc.poll() is None, "broker exited"
        time.sleep(1)
    print(f"{len(gpus)} GPU(s) ready in {time.time() - t:.0f} s", flush=True)
    return proc, client


def greedy(client):
    out = []
    for p in PROMPTS:
        r = client.generate(prompt_tokens=p, max_tokens=16, temperature=0, ignore_eos=True).collect()
        out.append((r["tokens"], r["logprobs"]))
    return out


def decode_rate(client, tokens: int = 64) -> float:
    """Tokens/s of one greedy request after its first token (kernels are compiled by then)."""
    stream = client.generate(prompt_tokens=PROMPTS[0], max_tokens=tokens, temperature=0, ignore_eos=True)
    next(stream)
    t = time.time()
    n = sum(len(part.tokens) for part in stream)
    return n / (time.time() - t)


def stop(proc, client):
    client.close()
    proc.terminate()
    proc.wait(timeout=60)


def main():
    model = sys.argv[1]
    tmp = Path(tempfile.mkdtemp())
    proc, client = serve(model, [0], tmp)
    t = time.time()
    one = greedy(client)
    print(f"1 GPU: {sum(len(x[0]) for x in one)} tokens in {time.time() - t:.1f}s (first use: compiles)",
          client.vram(query=True)["line"])
    print(f"1 GPU, every expert cached: decode {decode_rate(client):.2f} tok/s (batch 1)", flush=True)
    stop(proc, client)
    ballast = [probe(g, hold_s=3600, keep_gib=3.5) for g in (0, 1)]
    for b in ballast:
        print("ballast holds all but 3.5 GiB; it saw free MiB, ok:", b.stdout.readline().strip(), flush=True)
    proc, client = serve(model, [0, 1], tmp)
    try:
        start = client.vram(query=True)
        print("2 GPUs start-up:", start["line"], flush=True)
        t = time.time()
        two = greedy(client)
        print(f"2 GPUs: {sum(len(x[0]) for x in two)} tokens in {time.time() - t:.1f}s (first use: compiles)", flush=True)
        print(f"2 GPUs, caches of {start['expert_slots']} slots: decode {decode_rate(client):.2f} tok/s (batch 1)",
              flush=True)
        same = all(a[0] == b[0] for a, b in zip(one, two))
        dlp = max(float(np.abs(np.array(a[1]) - np.array(b[1])).max()) for a, b in zip(one, two))
        print(f"split tokens equal 1-GPU tokens: {same}; max |dlogprob| {dlp:.2e}", flush=True)
        before = [probe(g) for g in (0, 1)]
        print("second process before VRAM (free MiB after its context, took it):", before, flush=True)
        t = time.time()
        shrunk = client.vram([1700, 600])
        print(f"VRAM 1700 600 in {(time.time() - t) * 1e3:.0f} ms:", shrunk["line"], flush=True)
        after = [probe(g) for g in (0, 1)]
        print("second process after VRAM (free MiB after its own context, took it):", after, flush=True)
        again = greedy(client)
        print("tokens after shrink equal:", all(a[0] == b[0] for a, b in zip(one, again)), flush=True)
        t = time.time()
        bare = client.vram()
        print(f"bare VRAM in {(time.time() - t) * 1e3:.0f} ms:", bare["line"], flush=True)
        print("back to start-up sizes:", bare["expert_slots"] == start["expert_slots"], flush=True)
        gpus = client.info()["gpus"]
        print("cache counters:", [{k: g.get(k) for k in ("gpu", "layers", "hits", "misses", "h2d_bytes")} for g in gpus])
    finally:
        stop(proc, client)
        for b in ballast:
            b.kill()


if __name__ == "__main__":
    main()
