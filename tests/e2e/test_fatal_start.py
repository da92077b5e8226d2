"""A start that cannot succeed ends at once, saying why: `moebus serve` and `moebus generate` on a
checkpoint the loader refuses exit non-zero within seconds with the loader's own message, instead of
restarting the workers for ever (a worker that dies after READY is still restarted: test_worker_kill)."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from moebus.common.checkpoint import Checkpoint
from moebus.common.errors import CheckpointError
from moebus.common.safetensors_io import SafetensorsFile
from moebus.common.tiny_model import init_model
from tests.service import free_port

ATTENTION = "model.layers.0.self_attn.q_proj.weight"
EXPERT = "model.layers.1.mlp.experts.0.down_proj.weight"
# a start that cannot succeed ends instead of restarting its worker forever (issue 20: "in <= 15 s", which an
# unloaded box meets in a few seconds); the bound here only tells an exit from a wait: under the whole suite's load
# (2 cores, load average ~30) the fp8 case took 16.3 s (eighteenth session), and "never restarted" is asserted apart
MAX_EXIT_S = 60.0


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple, bytes]]) -> None:
    """``{name: (dtype name, shape, raw bytes)}`` as a safetensors file, any dtype name (the
    library's own writer only writes the dtypes moebus loads)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for _, _, raw in tensors.values():
            f.write(raw)


def _refused(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A tiny model with one tensor the loader refuses: ``fp8`` stores an attention projection as
    F8_E4M3 (as FP8 checkpoints do), ``missing`` lacks an expert tensor (a truncated download).
    Returns the directory and the loader's own message for that tensor."""
    model = init_model(tmp_path / kind, "qwen3_moe", "tiny", seed=0)
    f = SafetensorsFile(model / "model.safetensors")
    tensors = {n: (f.dtype_name(n), f.shape(n), f.array(n).tobytes()) for n in f.keys()}
    del f
    if kind == "fp8":
        bits = np.frombuffer(tensors[ATTENTION][2], np.uint16)
        tensors[ATTENTION] = ("F8_E4M3", tensors[ATTENTION][1], (bits >> 8).astype(np.uint8).tobytes())
        name = ATTENTION
    else:
        del tensors[EXPERT]
        name = EXPERT
    _write_safetensors(model / "model.safetensors", tensors)
    try:
        Checkpoint(model).tensor(name)
    except CheckpointError as e:
        return model, str(e)
    pytest.skip(f"the loader now accepts the {kind} checkpoint")


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return env


def _run(argv: list[str], timeout_s: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "moebus.cli", *argv], capture_output=True, text=True,
                          env=_env(), timeout=timeout_s)
    return done, time.monotonic() - started


@pytest.mark.parametrize("kind", ["fp8", "missing"])
def test_serve_on_a_refused_checkpoint_exits_at_once_with_the_loaders_message(tmp_path, kind):
    model, message = _refused(tmp_path, kind)
    config = tmp_path / "moebus.json"
    config.write_text(json.dumps({"model": str(model), "device": "cpu", "max_context": 256,
                                  "api": {"port": free_port()},
                                  "broker": {"frontend": f"tcp://127.0.0.1:{free_port()}"}}))
    done, took_s = _run(["serve", "--config", str(config)])
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0, done.stderr[-3000:]
    assert last.startswith("moebus: error: gpu0 worker cannot start") and message in last, done.stderr[-3000:]
    assert took_s <= MAX_EXIT_S, f"took {took_s:.1f} s"
    assert done.stderr.count("started gpu0 worker") == 1  # never restarted


def test_generate_on_a_refused_checkpoint_exits_at_once_with_the_loaders_message(tmp_path):
    model, message = _refused(tmp_path, "fp8")
    done, took_s = _run(["generate", "--model", str(model), "--device", "cpu", "--prompt", "Hello"])
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1] == f"moebus: error: gpu0 worker cannot start: {message}"
    assert took_s <= MAX_EXIT_S, f"took {took_s:.1f} s"
