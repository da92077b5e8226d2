"""Shared by the vision end-to-end tests: a tiny LLaVA serve with tight emulated GPUs (so the
hand-back really shrinks a cache), image files as data URLs, and the service's vision state."""
from __future__ import annotations

import base64
import contextlib
import io
import subprocess
import sys
import time
from pathlib import Path

from moebus.client import Client
from moebus.workers.vision_spare import SPARE_NAME
from tests.service import Service, alive, process_tree, running

# The tiny LLaVA's stage 0 needs ~1.5 MiB besides its 2 MiB expert cache (dense, KV and the step
# scratch its warm-up measures: ~0.22 MiB on cpu, a little different from run to run and branch to
# branch): a 4 MiB gpu0 with 1 MiB segments leaves the cache full at start-up with ~0.5 MiB free,
# half a segment from either edge, so the vision hand-back (1 MiB: the 0.2 MiB charge in whole MiB
# + 1) always shrinks it by one segment. gpu1 (~0.8 MiB besides its cache) keeps the same margin, and
# so do both stages of the tiny Qwen3-VL (tests/vision/test_qwen3vl_service.py).
VISION_SERVE = dict(emulated_vram_mib=[4, 3.3], segment_mib=1)


def vision_service(tmp, model, max_step_tokens: int = 512, max_context: int = 256, broker: dict | None = None,
                   **vision) -> Service:
    """The service, starting (wait_ready, or tests.service.running). The emulated GPUs' ledgers are
    under ``tmp / "vram"`` (for a ballast process to charge). The vision worker goes on gpu0 unless
    ``gpu`` says otherwise (the tests count gpu0's slots)."""
    return Service(tmp, model, vision={"idle_s": 1.0, "gpu": 0, **vision}, max_step_tokens=max_step_tokens,
                   max_context=max_context, broker=broker or {}, emulated_vram_dir=str(tmp / "vram"), **VISION_SERVE)


def start_vision_service(tmp, model, **settings) -> Service:
    """vision_service's service, ready."""
    return vision_service(tmp, model, **settings).wait_ready()


@contextlib.contextmanager
def served_vision(tmp, model, **settings):
    """(service, ZeroMQ client of it) for the block, vision_service's ``settings``; then the client is
    closed and the service stopped (every process it started must be gone)."""
    with running(vision_service(tmp, model, **settings)) as svc, \
            contextlib.closing(Client(svc.zmq_address, timeout_s=30)) as client:
        yield svc, client


BALLAST = """
import sys
from moebus.cuda.memory.ledger import EmulatedGpu
gpu = EmulatedGpu(sys.argv[1])
free_bytes = gpu.memory_info()[0]
gpu.allocate(free_bytes, "ballast")
print(free_bytes, flush=True)
sys.stdin.read()  # held until the test closes our stdin (or dies: the ledger drops dead processes)
"""


@contextlib.contextmanager
def ballast(ledger_path: Path):
    """Another process holding every free byte of one emulated GPU while the block runs."""
    proc = subprocess.Popen([sys.executable, "-c", BALLAST, str(ledger_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        held = proc.stdout.readline().strip()
        assert held.isdigit(), "the ballast process did not start"
        yield int(held)
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_message(urls: list[str], text: str = "Describe the picture.") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def vision_state(client: Client) -> dict:
    info = client.info()
    return {**info["vision"], "loaded": info["vision_loaded"], "starts": info["counters"]["vision_starts_total"],
            "slots": sum(client.vram(query=True)["expert_slots"])}


def wait_cold(client: Client, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        state = vision_state(client)
        if state["state"] == "cold" and state["waiting"] == 0:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"vision not cold within {timeout_s} s: {state}")
        time.sleep(0.05)


def vision_worker_pids(service: Service, zygote_pid: int) -> list[int]:
    """Live children of the zygote that are started vision workers (not its spare, vision_spare.py)."""
    return [p for p in _children(zygote_pid) if _comm(p) != SPARE_NAME]


def spare_pids(zygote_pid: int) -> list[int]:
    """Live children of the zygote that are spares waiting for their start (named ``vision-spare``)."""
    return [p for p in _children(zygote_pid) if _comm(p) == SPARE_NAME]


def _children(zygote_pid: int) -> list[int]:
    return [p for p in process_tree(zygote_pid) if p != zygote_pid and alive(p)]


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None  # (gone)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def zygote_pid(service: Service) -> int:
    """The broker's child running ``vision-zygote`` (its forked workers share the command line)."""
    for pid in process_tree(service.proc.pid):
        try:
            if b"vision-zygote" in Path(f"/proc/{pid}/cmdline").read_bytes() and _parent(pid) == service.proc.pid:
                return pid
        except OSError:
            continue
    raise AssertionError("no vision zygote in the service's process tree")
