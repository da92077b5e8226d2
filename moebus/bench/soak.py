"""``moebus bench soak``: a `moebus serve` of its own under mixed load for a while — generations,
random cancels, HTTP streams, VRAM resizes, bad requests — while the RSS of every process (and, on
cuda, its VRAM) is sampled. After a warm-up, each process's growth is fitted (MiB per minute); a
process that keeps growing is flagged. A deliberately leaking process runs beside them as a
negative control: the same code must flag it, else the check proves nothing. Exit status 0 when
every moebus process is flat and the control is flagged."""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

LEAK_MIB_PER_S = 2.0  # the negative control's growth
LEAK_SCRIPT = """
import sys, time
keep = []
while True:
    keep.append(bytearray(int(float(sys.argv[1]) * 2 ** 20)))
    for b in keep[-1:]:
        b[::4096] = b"x" * len(b[::4096])  # touch every page, so the growth is resident
    time.sleep(1.0)
"""


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def tree(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                kids.setdefault(int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        out.append(p := todo.pop())
        todo += kids.get(p, [])
    return out


def name_of(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [a.decode(errors="replace") for a in argv]
    if "moebus.cli" in words:
        rest = words[words.index("moebus.cli") + 1:]
        return " ".join(rest[:1] + [rest[rest.index("--gpu") + 1]] if "--gpu" in rest else rest[:1])
    return "leak control" if any("keep.append" in w for w in words) else Path(words[0]).name


def vram_mib() -> dict[int, float]:
    """pid -> MiB used on any GPU (nvidia-smi), empty without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    used: dict[int, float] = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit():
            used[int(pid)] = used.get(int(pid), 0.0) + float(mib or 0)
    return used


def growth(samples: list[tuple[float, float]], warmup_frac: float) -> tuple[float, float]:
    """(MiB per minute by least squares, settled growth) over the samples after the warm-up. The
    settled growth is how far the lowest value of the last half stays above the highest of the
    first half: a leak keeps climbing, while caches that shrink and regrow with VRAM requests, or
    an allocator's ups and downs, overlap and give <= 0."""
    if len(samples) < 6:
        return 0.0, 0.0
    t0 = samples[0][0] + warmup_frac * (samples[-1][0] - samples[0][0])
    kept = [(t, v) for t, v in samples if t >= t0]
    if len(kept) < 4:
        return 0.0, 0.0
    t, v = np.array([s[0] for s in kept]), np.array([s[1] for s in kept])
    slope = float(np.polyfit(t - t[0], v, 1)[0]) if np.ptp(t) > 0 else 0.0
    half = len(v) // 2
    return slope * 60, float(v[half:].min() - v[:half].max())


def is_leaking(per_min: float, settled_mib: float, max_mib_per_min: float) -> bool:
    return per_min > max_mib_per_min and settled_mib > 1.0


class Load:
    """Mixed traffic from a few threads until ``stop``; counts what happened."""

    def __init__(self, zmq_address: str, http_url: str, elastic: bool, seed: int = 0):
        from moebus.client import Client

        self.client = Client(zmq_address, timeout_s=120)
        self.http_url, self.elastic = http_url, elastic
        self.stop = threading.Event()
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()
        self.rng = random.Random(seed)

    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    def run(self, threads: int = 4) -> list[threading.Thread]:
        workers = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(threads)]
        workers.append(threading.Thread(target=self._vram_loop, daemon=True))
        for t in workers:
            t.start()
        return workers

    def _loop(self, i: int) -> None:
        rng = random.Random(i)
        while not self.stop.is_set():
            kind = rng.choices(["generate", "cancel", "http", "bad"], [6, 2, 1, 1])[0]
            try:
                getattr(self, "_" + kind)(rng)
                self.count(kind)
            except Exception as e:  # noqa: BLE001 - counted: a soak reports, it does not stop
                self.count(f"{kind} failed: {type(e).__name__}")

    def _generate(self, rng) -> None:
        self.client.generate(prompt_tokens=[rng.randrange(1, 200) for _ in range(rng.randint(2, 40))],
                             max_tokens=rng.randint(2, 24), temperature=rng.choice([0.0, 0.8])).collect()

    def _cancel(self, rng) -> None:
        stream = self.client.generate(prompt="cancel me " * rng.randint(1, 20), max_tokens=64, ignore_eos=True)
        next(stream, None)
        stream.close()

    def _http(self, rng) -> None:
        import requests

        body = {"prompt": [1, 2, 3], "max_tokens": rng.randint(2, 12), "stream": rng.random() < 0.5}
        r = requests.post(self.http_url + "/v1/completions", json=body, timeout=60)
        r.raise_for_status()

    def _bad(self, rng) -> None:
        import requests
        import zmq

        bad = rng.choice([{"prompt": [1], "top_k": 2 ** 31}, {"prompt": [2 ** 40]}, {"prompt": "x", "max_tokens": -1}])
        assert requests.post(self.http_url + "/v1/completions", json=bad, timeout=30).status_code == 400
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.client.address)
        sock.send_multipart([b"STEP", os.urandom(rng.randint(1, 64))])
        sock.poll(5000)
        sock.close()

    def _vram_loop(self) -> None:
        while self.elastic and not self.stop.wait(3.0):
            try:
                self.client.vram(None if self.rng.random() < 0.4 else [self.rng.choice([0, 2, 4])], query=False)
                self.count("vram")
            except Exception as e:  # noqa: BLE001
                self.count(f"vram failed: {type(e).__name__}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(args, tmp: Path) -> tuple[subprocess.Popen, str, str]:
    port, address = free_port(), f"ipc://{tmp / 'frontend.sock'}"
    env = dict(os.environ, MOEBUS_API__PORT=str(port), MOEBUS_BROKER__FRONTEND=address, PYTHONUNBUFFERED="1")
    flags = [f for flag in ("config", "model", "device") if getattr(args, flag) for f in (f"--{flag}", getattr(args, flag))]
    proc = subprocess.Popen([sys.executable, "-m", "moebus.cli", "serve", *flags], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, address, f"http://127.0.0.1:{port}"


def wait_ready(address: str, proc: subprocess.Popen, timeout_s: float = 600) -> bool:
    """Wait for the service; True when its caches are elastic (a bare VRAM, a no-op now, is taken)."""
    from moebus.client import Client
    from moebus.common.errors import RequestError

    client = Client(address)
    try:
        deadline = time.monotonic() + timeout_s
        while not client.ping(timeout_s=1.0):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"moebus serve did not become ready (status {proc.poll()})")
            time.sleep(0.2)
        try:
            return "error" not in client.vram(None)
        except RequestError:
            return False
    finally:
        client.close()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="moebus bench soak", description=__doc__)
    p.add_argument("--config")
    p.add_argument("--model")
    p.add_argument("--device")
    p.add_argument("--duration-s", type=float, default=180.0)
    p.add_argument("--sample-s", type=float, default=1.0)
    p.add_argument("--warmup", type=float, default=0.34, help="fraction of the run left out of the fit")
    p.add_argument("--max-mib-per-min", type=float, default=6.0, help="growth above this is a leak")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="moebus-soak-") as tmp:
        proc, address, url = start_serve(args, Path(tmp))
        control = subprocess.Popen([sys.executable, "-c", LEAK_SCRIPT, str(LEAK_MIB_PER_S)])
        try:
            report = soak(args, proc, control, address, url, elastic=wait_ready(address, proc))
        finally:
            control.kill()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    print(json.dumps(report) if args.json else format_report(report))
    return 0 if report["ok"] else 1


def warm_up(url: str, rounds: int = 600) -> None:
    """Touch every api thread once (waitress hands requests to its threads in turn), so that the
    first use of each thread's stack is not mistaken for growth."""
    import requests

    with requests.Session() as session:
        for _ in range(rounds):
            session.get(url + "/health", timeout=30)


def soak(args, proc, control, address: str, url: str, elastic: bool) -> dict:
    warm_up(url)
    load = Load(address, url, elastic)
    threads = load.run()
    series: dict[int, dict] = {}
    started = time.monotonic()
    while time.monotonic() - started < args.duration_s:
        now, gpu = time.monotonic() - started, vram_mib()
        for pid in tree(proc.pid) + [control.pid]:
            mib = rss_mib(pid)
            if mib is not None:
                entry = series.setdefault(pid, {"name": name_of(pid), "rss": [], "vram": []})
                entry["rss"].append((now, mib))
                if pid in gpu:
                    entry["vram"].append((now, gpu[pid]))
        time.sleep(args.sample_s)
    load.stop.set()
    for t in threads:
        t.join(timeout=30)
    load.client.close()
    return {**summarize(series, control.pid, args), "load": dict(sorted(load.counts.items()))}


def summarize(series: dict[int, dict], control_pid: int, args) -> dict:
    processes = []
    for pid, entry in series.items():
        per_min, grown = growth(entry["rss"], args.warmup)
        vram_per_min, vram_grown = growth(entry["vram"], args.warmup)
        processes.append({"pid": pid, "name": entry["name"], "control": pid == control_pid,
                          "rss_mib": [round(v, 1) for _, v in entry["rss"]],
                          "vram_mib": [round(v, 1) for _, v in entry["vram"]],
                          "rss_mib_per_min": round(per_min, 2), "rss_settled_growth_mib": round(grown, 1),
                          "vram_mib_per_min": round(vram_per_min, 2),
                          "leaking": is_leaking(per_min, grown, args.max_mib_per_min)
                          or is_leaking(vram_per_min, vram_grown, args.max_mib_per_min)})
    control_flagged = any(p["control"] and p["leaking"] for p in processes)
    moebus_flat = not any(p["leaking"] for p in processes if not p["control"])
    return {"duration_s": args.duration_s, "processes": processes, "control_flagged": control_flagged,
            "moebus_flat": moebus_flat, "ok": control_flagged and moebus_flat}


def format_report(report: dict) -> str:
    lines = [f"soak {report['duration_s']:.0f} s: RSS (MiB) per process, sampled every second; growth fitted after "
             "the warm-up", f"{'process':<16} {'pid':>7} {'first':>8} {'last':>8} {'MiB/min':>8} {'VRAM last':>10}  verdict"]
    for p in sorted(report["processes"], key=lambda p: (p["control"], p["name"])):
        rss, vram = p["rss_mib"], p["vram_mib"]
        verdict = "LEAK" if p["leaking"] else "flat"
        if p["control"]:
            verdict += " (negative control: must be LEAK)"
        lines.append(f"{p['name']:<16} {p['pid']:>7} {rss[0]:>8.1f} {rss[-1]:>8.1f} {p['rss_mib_per_min']:>8.2f} "
                     f"{(f'{vram[-1]:.0f}' if vram else '-'):>10}  {verdict}")
    lines.append("load: " + ", ".join(f"{k} {v}" for k, v in report.get("load", {}).items()))
    lines.append("OK: moebus flat, control flagged" if report["ok"] else
                 f"FAILED: moebus flat={report['moebus_flat']}, control flagged={report['control_flagged']}")
    return "\n".join(lines)
