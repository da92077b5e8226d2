"""`moebus bench hop --broker DIR`: the step hop with the broker in it. A real `moebus broker` (one
stage, DIR's config and tokenizer) drives the same worker as `bench hop` (a real BrokerLink whose
compute thread answers each STEP at once, or after holding the GIL for --compute-ms), and a real
client streams one greedy generation. Each PARTIAL's interval at the client, minus the compute, is
what a step through the service adds: the broker's turn (reply decode, tokens accepted and
streamed, the next step planned and encoded), both ZeroMQ hops and the worker's link."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT_TOKENS = 8


def token_intervals_s(model_dir: str, steps: int, compute_ms: float, wait_ms: float = 0.0) -> list[float]:
    """The client-side intervals between consecutive PARTIALs of one ``steps``-token generation."""
    from moebus.cli_generate import private_broker
    from moebus.common.model_config import load_config

    model_dir = str(Path(model_dir).resolve())
    max_context = PROMPT_TOKENS + steps + 8
    ready = {"layers": [0, load_config(model_dir).num_layers], "model": Path(model_dir).name, "max_batch": 1,
             "max_context": max_context}  # what the broker checks a stage's READY against
    with tempfile.TemporaryDirectory(prefix="moebus-hop-") as tmp:
        backend = f"ipc://{Path(tmp) / 'backend.sock'}"
        worker = subprocess.Popen([sys.executable, "-m", "moebus.cli", "bench", "hop", "--serve", backend,
                                   "--compute-ms", str(compute_ms), "--wait-ms", str(wait_ms), "--ready", json.dumps(ready)])
        env = {"MOEBUS_BROKER__BACKEND": backend, "MOEBUS_BROKER__REMOTE_GPUS": "[0]",
               "MOEBUS_EMULATED_VRAM_MIB": "[112]", "MOEBUS_MAX_BATCH": "1", "MOEBUS_MAX_CONTEXT": str(max_context)}
        try:
            with private_broker(["--model", model_dir, "--device", "cpu"], env=env, timeout_s=120) as address:
                return _stream_intervals_s(address, steps)
        finally:
            try:
                worker.wait(timeout=10)  # the broker's SHUTDOWN ends it
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()


def _stream_intervals_s(address: str, steps: int) -> list[float]:
    from moebus.client import Client

    client = Client(address)
    try:
        stream = client.generate(prompt_tokens=list(range(10, 10 + PROMPT_TOKENS)), max_tokens=steps,
                                 temperature=0, ignore_eos=True)
        arrivals_s = [time.perf_counter() for _part in stream]
    finally:
        client.close()
    return [b - a for a, b in zip(arrivals_s, arrivals_s[1:])]
