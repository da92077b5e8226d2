"""The forward pass must not depend on what is resident: greedy tokens and logprobs are identical
with every expert cached and with a cache of 10% of them (eviction on nearly every layer)."""
import numpy as np

from moebus.common.checkpoint import Checkpoint
from moebus.cuda.backend import CpuBackend
from moebus.workers.experts import build_expert_cache
from moebus.workers.local import LocalModel
from moebus.workers.stage import Stage


def small_cache_model(model_dir, fraction: float) -> LocalModel:
    model = LocalModel(model_dir, device="cpu")
    ckpt, backend = model.ckpt, model.backend
    layers = range(ckpt.config.num_layers)
    blob = model.stages[0].experts.store.blob_bytes
    capacity = int(blob * ckpt.config.num_experts * len(layers) * fraction)
    cache = build_expert_cache(ckpt, layers, backend, capacity_bytes=capacity)
    model.stages = [Stage(ckpt, layers, backend, 8, 1024, experts=cache)]
    return model


def test_greedy_tokens_and_logprobs_identical_at_100_and_10_percent(model_dirs):
    full = LocalModel(model_dirs["init_qwen3"], device="cpu")
    small = small_cache_model(model_dirs["init_qwen3"], 0.10)
    cache = small.stages[0].experts
    assert cache.num_slots < 0.2 * 8 * 4  # 8 experts x 4 layers: really a small cache
    prompt = [5, 17, 99, 3, 42, 7, 250, 31, 8]
    a, b = full.generate(prompt, 24), small.generate(prompt, 24)
    assert a.tokens == b.tokens
    assert np.array_equal(np.array(a.logprobs), np.array(b.logprobs))
    assert cache.misses > cache.num_slots  # it really evicted and reloaded
