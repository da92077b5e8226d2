"""`moebus generate --local` reads the settings' expert and KV dtypes as the served workers do: fp8
experts (or a bf16 KV cache) give other log-probabilities than bf16 experts (a float32 cache), and the
default run equals the in-process model's."""
import json
import os
import subprocess
import sys

import numpy as np

from moebus.workers.local import LocalModel

PROMPT = [5, 17, 99, 3]


def _generate(model_dir, dtype: str, kv_dtype: str = "auto") -> dict:
    env = dict(os.environ, MOEBUS_EXPERTS__DTYPE=dtype, MOEBUS_KV_DTYPE=kv_dtype)
    out = subprocess.run([sys.executable, "-m", "moebus.cli", "generate", "--local", "--model", str(model_dir),
                          "--device", "cpu", "--prompt-tokens", ",".join(map(str, PROMPT)), "--max-tokens", "4",
                          "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_generate_local_follows_the_experts_dtype(tiny_model):
    bf16, fp8 = _generate(tiny_model, "bf16"), _generate(tiny_model, "fp8")
    want = LocalModel(tiny_model, device="cpu").generate(PROMPT, 4, 0.0, 0, 1.0, None)
    assert bf16["tokens"] == list(want.tokens)
    np.testing.assert_allclose(bf16["logprobs"], want.logprobs, atol=1e-6)
    assert len(fp8["tokens"]) == 4
    assert not np.allclose(fp8["logprobs"], bf16["logprobs"], atol=1e-6)  # the quantized experts were used


def test_generate_local_follows_the_kv_dtype(tiny_model):
    fp32, bf16 = _generate(tiny_model, "bf16", "fp32"), _generate(tiny_model, "bf16", "bf16")
    want = LocalModel(tiny_model, device="cpu", kv_dtype="bf16").generate(PROMPT, 4, 0.0, 0, 1.0, None)
    np.testing.assert_allclose(bf16["logprobs"], want.logprobs, atol=1e-6)
    assert not np.allclose(bf16["logprobs"], fp32["logprobs"], atol=1e-6)  # the bf16 cache was used
