"""docker/ without a Docker engine: Debian's docker-compose validates the compose file and its
profiles; the image's install steps (docker/install.sh) are replayed in a fresh venv, with the CUDA
extra resolved but not downloaded; the container's command (docker/entrypoint.sh with the image's
config) serves the embedded model on cpu and answers a chat; the Grafana dashboard plots only
metrics that /metrics exports."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import requests
import yaml

from tests.service import alive, free_port, process_tree
from tests.test_docs import exported_metrics

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
PROFILES = ("split", "remote-stage")


def compose(*args: str, env: dict | None = None) -> str:
    if shutil.which("docker-compose") is None:
        message = "Debian's docker-compose is not installed (make test installs it when run as root)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    out = subprocess.run(["docker-compose", "-f", str(DOCKER / "docker-compose.yml"), *args], capture_output=True,
                         text=True, timeout=60, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_compose_file_validates_with_gpu_reservations_and_no_host_ipc():
    services = {}
    for profile in ("", *PROFILES):
        config = yaml.safe_load(compose(*(["--profile", profile] if profile else []), "config"))
        services.update(config["services"])
    assert set(services) == {"moebus", "broker", "api", "worker0", "worker1", "moebus-stage0", "stage1"}
    for name, svc in services.items():
        assert "ipc" not in svc, name
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        runs_a_stage = name in ("moebus", "worker0", "worker1", "moebus-stage0", "stage1")
        assert bool(devices) == runs_a_stage and all("gpu" in d["capabilities"] for d in devices), name
    assert services["worker1"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["1"]
    targets = {v["target"] if isinstance(v, dict) else v.split(":")[1] for v in services["moebus"]["volumes"]}
    assert {"/cache", "/models"} <= targets  # the kernel cache and the demo model on a volume; models mounted
    assert services["moebus"]["secrets"][0]["source"] == "moebus_api_key"


def test_dockerfile_runs_as_a_user_with_a_healthcheck_and_the_cuda_extra():
    text = (DOCKER / "Dockerfile").read_text()
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and user[-1] not in ("root", "0")
    assert re.search(r"^HEALTHCHECK .*healthcheck\.py", text, re.M)
    assert "docker/install.sh" in text and "MOEBUS_KERNEL_CACHE_DIR=/cache/kernels" in text


def test_cuda_extra_brings_nvvm_and_libdevice(tmp_path):
    """moebus' `cuda` extra, resolved (not installed): numba-cuda's cu12 extra, whose CUDA toolkit
    wheels include nvcc's, which carries NVVM and libdevice."""
    report = tmp_path / "report.json"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                          "--report", str(report), f"{ROOT}[cuda]"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    names = {p["metadata"]["name"].lower() for p in json.loads(report.read_text())["install"]}
    assert {"moebus", "numba-cuda", "cuda-toolkit", "nvidia-cuda-nvcc-cu12"} <= names, sorted(names)
    assert not names & {"torch", "transformers"}


def _wait_healthy(proc, port: int, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"the container's command exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
        assert "worker exited" not in log.read_text(), log.read_text()[-4000:]
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, f"not healthy in {timeout_s} s:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)


def _stop(proc) -> list[int]:
    tree = process_tree(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in tree):
        time.sleep(0.1)
    return [p for p in tree if alive(p)]


def test_image_install_steps_then_the_container_command_answers_a_chat(tmp_path):
    venv = tmp_path / "venv"
    install = subprocess.run(["sh", str(DOCKER / "install.sh"), str(venv), str(ROOT)], capture_output=True, text=True,
                             timeout=600, env={**os.environ, "EXTRAS": ""})  # the cuda extra: resolved above
    assert install.returncode == 0, install.stderr[-4000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NUMBA_ENABLE_CUDASIM")}
    env.update(PATH=f"{venv / 'bin'}:{env['PATH']}", MOEBUS_CACHE_DIR=str(tmp_path / "cache"),
               MOEBUS_KERNEL_CACHE_DIR=str(tmp_path / "cache" / "kernels"), PYTHONUNBUFFERED="1")
    entrypoint = [str(DOCKER / "entrypoint.sh"), "serve", "--config", str(DOCKER / "moebus.json")]

    refused = subprocess.run(entrypoint, capture_output=True, text=True, timeout=120,
                             env={**env, "MOEBUS_API_KEY_FILE": str(tmp_path / "none")})
    assert refused.returncode != 0 and "without an API key" in refused.stderr  # the image listens on 0.0.0.0

    key_file = tmp_path / "api_key.txt"
    key_file.write_text("sk-from-a-secret-file\n")
    port, frontend = free_port(), free_port()
    # on cpu the emulated GPUs of `make serve` (56 MiB) take the default context, not the 4096 tokens
    # that the image's config sets for a real GPU
    env.update(MOEBUS_DEVICE="cpu", MOEBUS_MAX_CONTEXT="2048",
               MOEBUS_API__HOST="127.0.0.1", MOEBUS_API__PORT=str(port),
               MOEBUS_BROKER__FRONTEND=f"tcp://127.0.0.1:{frontend}", MOEBUS_API_KEY_FILE=str(key_file))
    log = tmp_path / "container.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(entrypoint, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_healthy(proc, port, 120, log)
        health = subprocess.run([str(venv / "bin" / "python"), str(DOCKER / "healthcheck.py")], env=env, timeout=30)
        assert health.returncode == 0
        base = f"http://127.0.0.1:{port}"
        assert requests.get(base + "/v1/models", timeout=10).status_code == 401
        with openai.OpenAI(base_url=base + "/v1", api_key="sk-from-a-secret-file", max_retries=0, timeout=60) as c:
            out = c.chat.completions.create(model="moebus", max_tokens=8,
                                            messages=[{"role": "user", "content": "Hello from docker"}])
        assert out.choices[0].message.content is not None and out.usage.completion_tokens >= 1
        page = requests.get(base + "/dashboard", timeout=10)  # the static files came with the (non-editable) install
        assert page.status_code == 200 and "residency" in page.text
    finally:
        assert _stop(proc) == []


def test_grafana_dashboard_plots_exported_metrics_only():
    dashboard = json.loads((DOCKER / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"moebus_[a-z0-9_]+", e)}
    exported = exported_metrics()
    assert used and not used - exported, sorted(used - exported)
    assert {"moebus_expert_cache_hits_total", "moebus_gpu_expert_slots", "moebus_gpu_free_mib"} <= used
