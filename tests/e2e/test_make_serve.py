"""`make serve` as a new user runs it, into a fresh venv: it installs the runtime dependencies only
(no torch, no transformers, no test tools), then `moebus serve` without a model serves the embedded
demo model, made on first use into MOEBUS_CACHE_DIR (a fresh directory here), and answers a chat
and the README's own image example, run as written (a 64x64 PNG as a data URL through the chat)."""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import openai
import requests
from PIL import Image

from moebus.client import Client
from tests.service import alive, free_port, process_tree

ROOT = Path(__file__).resolve().parents[2]
TEST_ONLY = {"torch", "transformers", "pytest", "hypothesis", "openai"}


def _wait_ready(proc, zmq_address: str, base_url: str, log: Path, timeout_s: float) -> None:
    client = Client(zmq_address)
    try:
        deadline = time.monotonic() + timeout_s
        while not (client.ping(timeout_s=0.5) and _healthy(base_url)):
            assert proc.poll() is None, f"make serve exited with {proc.returncode}:\n{log.read_text()[-6000:]}"
            assert time.monotonic() < deadline, f"not ready in {timeout_s} s:\n{log.read_text()[-6000:]}"
            time.sleep(0.2)
    finally:
        client.close()


def _healthy(base_url: str) -> bool:
    try:
        return requests.get(base_url + "/health", timeout=1).status_code == 200
    except requests.RequestException:
        return False


def _stop_group(proc) -> list[int]:
    """SIGTERM to make and what it started (one process group, as a terminal's Ctrl-C would reach
    them); returns the pids still alive afterwards."""
    tree = process_tree(proc.pid)
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(p) for p in tree):
        time.sleep(0.1)
    left = [p for p in tree if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    return left


def readme_image_example() -> str:
    """The README's Python block that sends an image (it uses the ``client`` of the block before)."""
    blocks = [b.split("```")[0] for b in (ROOT / "README.md").read_text().split("```python\n")[1:]]
    return next(b for b in blocks if "image_url" in b)


def test_make_serve_installs_the_runtime_only_and_answers_a_chat(tmp_path, monkeypatch, capsys):
    venv, http_port, zmq_port = tmp_path / "venv", free_port(), free_port()
    config = tmp_path / "moebus.json"  # only the ports differ from what a plain `make serve` uses
    config.write_text(json.dumps({"api": {"port": http_port}, "broker": {"frontend": f"tcp://127.0.0.1:{zmq_port}",
                                                                         "drain_s": 2.0}}))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NUMBA_ENABLE_CUDASIM", "MOEBUS_CONFIG")}
    env.update(MOEBUS_CACHE_DIR=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    log = tmp_path / "make-serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["make", "-s", "-C", str(ROOT), "serve", f"VENV={venv}", f"ARGS=--config {config}"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        base_url = f"http://127.0.0.1:{http_port}"
        _wait_ready(proc, f"tcp://127.0.0.1:{zmq_port}", base_url, log, timeout_s=600)
        listed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"], check=True,
                                capture_output=True, text=True, env=env).stdout
        installed = {p["name"].lower() for p in json.loads(listed)}
        assert "moebus" in installed and not installed & TEST_ONLY, installed & TEST_ONLY

        with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            model = client.models.list().data[0].id
            out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}],
                                                 max_tokens=8)
            assert out.choices[0].message.content is not None and out.usage.completion_tokens >= 1

            monkeypatch.chdir(tmp_path)
            Image.new("RGB", (64, 64), (200, 120, 40)).save("cat.png")
            example = {"client": client}
            exec(readme_image_example(), example)  # raises openai.APIStatusError on a 503
        image_out = example["out"]
        assert image_out.usage.prompt_tokens > 64 and image_out.usage.completion_tokens >= 1  # the image's tokens
        assert capsys.readouterr().out == image_out.choices[0].message.content + "\n"
        assert (tmp_path / "cache" / model / "config.json").is_file()
    finally:
        assert _stop_group(proc) == []
