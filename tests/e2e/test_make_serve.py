"""What ``make serve`` does on a fresh clone: install the runtime dependencies only (a fresh venv,
no torch, no transformers), then ``moebus serve`` without a model serves the embedded demo model,
made on first use into MOEBUS_CACHE_DIR (a fresh directory here)."""
import json
import subprocess
from pathlib import Path

import openai

from tests.service import Service

ROOT = Path(__file__).resolve().parents[2]
TEST_ONLY = {"torch", "transformers", "pytest", "hypothesis", "openai"}


def test_make_serve_installs_the_runtime_only_and_answers_a_chat(tmp_path):
    venv = tmp_path / "venv"
    # the install half of `make serve` (the other half, `$(BIN)/moebus serve`, is launched below)
    subprocess.run(["make", "-s", "-C", str(ROOT), "install", f"VENV={venv}"], check=True, timeout=600,
                   capture_output=True)
    listed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"], check=True,
                            capture_output=True, text=True).stdout
    installed = {p["name"].lower() for p in json.loads(listed)}
    assert "moebus" in installed and not installed & TEST_ONLY, installed & TEST_ONLY

    svc = Service(tmp_path, None, env={"MOEBUS_CACHE_DIR": str(tmp_path / "cache")},
                  launcher=[str(venv / "bin" / "moebus")])
    try:
        svc.wait_ready(timeout_s=180)
        client = openai.OpenAI(base_url=svc.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}],
                                             max_tokens=8)
        assert out.choices[0].message.content is not None and out.usage.completion_tokens >= 1
        assert (tmp_path / "cache" / model / "config.json").is_file()
        client.close()
    finally:
        assert svc.stop() == []
