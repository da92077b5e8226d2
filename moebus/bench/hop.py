"""The broker's step hop without a model: round trips of a batch-1 decode STEP from a ROUTER (as the
broker sends it) through a real BrokerLink in a worker process, whose compute thread answers each
STEP with a STEP_REPLY at once (or after holding the GIL for --compute-ms, as a launch-bound step
does). What it times is what a step through the service adds to the stage's compute: the codec
both ways, the worker's IO thread and its hand-over to the compute thread, ZeroMQ over ipc."""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

from moebus.common import transport, wire
from moebus.common.protocol import Heartbeat, Ready, Shutdown, Step, StepReply


def decode_step(step_id: int) -> Step:
    """A batch-1 decode STEP to the only stage: the arrays the broker sends every token."""
    return Step(step_id=step_id, slots=np.zeros(1, np.int32), starts=np.array([40], np.int32),
                lengths=np.ones(1, np.int32), tokens=np.array([17], np.int32), temperature=np.zeros(1, np.float32),
                top_k=np.zeros(1, np.int32), top_p=np.ones(1, np.float32), u=np.full(1, 0.5, np.float32))


def serve(address: str, compute_s: float, ready: dict | None = None, wait_s: float = 0.0) -> None:
    """The worker side: a real BrokerLink; the compute thread answers every STEP. ``ready``: READY's
    fields that a real broker checks (layers, model, max_batch, max_context; see bench/hop_broker.py)."""
    from moebus.workers.link import BrokerLink

    link = BrokerLink(address, "gpu0")
    link.start(Ready(**{"layers": (0, 1), **(ready or {})}, gpu=0, generation=link.generation, device="cpu"))
    try:
        while not isinstance(message := link.recv(timeout_s=1.0), Shutdown):
            if not isinstance(message, Step):
                continue
            end = time.perf_counter() + compute_s
            while time.perf_counter() < end:  # holds the GIL, as a step of numba launches does
                pass
            if wait_s:
                time.sleep(wait_s)  # the GIL released, as a step waiting for its GPU kernels
            link.send(StepReply(step_id=message.step_id, generation=link.generation, compute_s=compute_s + wait_s,
                                tokens=np.full(len(message.slots), 3, np.int32),
                                logprobs=np.full(len(message.slots), -0.5, np.float32)))
    finally:
        link.close()


def _round_trips(sock, identity: bytes, steps: int, beat_every: int) -> list[float]:
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    times_s = []
    for i in range(steps):
        start = time.perf_counter()
        transport.send(sock, decode_step(i), identity=identity)
        if i % beat_every == 0:
            transport.send(sock, Heartbeat(), identity=identity)  # the broker beats about once a second
        while True:
            if not poller.poll(5000):
                raise TimeoutError("the worker did not answer a STEP within 5 s")
            if isinstance(wire.decode(transport.recv_frames(sock, routed=True)[1]), StepReply):
                break
        times_s.append(time.perf_counter() - start)
    return times_s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moebus bench hop")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--compute-ms", type=float, default=0.0, help="GIL-holding work per step in the worker")
    p.add_argument("--wait-ms", type=float, default=0.0, help="then a wait with the GIL released (a GPU step)")
    p.add_argument("--broker", metavar="DIR", help="through a real broker serving DIR's config and tokenizer "
                   "(e.g. `moebus init-model --preset tiny DIR`) and a streaming client: PARTIAL intervals")
    p.add_argument("--serve", help=argparse.SUPPRESS)  # the worker process's own entry
    p.add_argument("--ready", help=argparse.SUPPRESS)  # its READY's fields, JSON
    args = p.parse_args(argv)
    compute_s = args.compute_ms / 1e3
    if args.serve:
        serve(args.serve, compute_s, json.loads(args.ready) if args.ready else None, args.wait_ms / 1e3)
        return 0
    if args.broker:
        from moebus.bench.hop_broker import token_intervals_s

        times_s = token_intervals_s(args.broker, args.warmup + args.steps + 1, args.compute_ms, args.wait_ms)
        _report("hop through the broker (PARTIAL interval minus compute", times_s[args.warmup:],
                compute_s + args.wait_ms / 1e3, args)
        return 0
    with tempfile.TemporaryDirectory(prefix="moebus-hop-") as tmp:
        address = f"ipc://{Path(tmp) / 'backend.sock'}"
        sock = transport.make_socket(zmq.Context.instance(), zmq.ROUTER)
        sock.bind(address)
        child = subprocess.Popen([sys.executable, "-m", "moebus.cli", "bench", "hop", "--serve", address,
                                  "--compute-ms", str(args.compute_ms), "--wait-ms", str(args.wait_ms)])
        try:
            if not sock.poll(60_000):
                raise TimeoutError("the worker process did not send READY")
            identity, _ = transport.recv_frames(sock, routed=True)
            times_s = _round_trips(sock, identity, args.warmup + args.steps, max(int(1 / (compute_s + 5e-4)), 1))
            transport.send(sock, Shutdown(), identity=identity)
            child.wait(timeout=10)
        finally:
            if child.poll() is None:
                child.kill()
            sock.close()
    _report("hop (round trip minus compute", times_s[args.warmup:], compute_s + args.wait_ms / 1e3, args)
    return 0


def _report(what: str, times_s: list[float], compute_s: float, args) -> None:
    added_us = sorted((t - compute_s) * 1e6 for t in times_s)
    print(f"{what}, {len(added_us)} steps, compute {args.compute_ms:g} ms, wait {args.wait_ms:g} ms): "
          f"median {statistics.median(added_us):.0f} us  mean {statistics.mean(added_us):.0f} us  "
          f"p90 {added_us[int(len(added_us) * 0.9)]:.0f} us")
