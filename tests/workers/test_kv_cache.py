"""The KV cache's element type (``kv_dtype``): sizes per dtype, the setting, and a bf16 cache on the
cpu device against float32 on the tiny model."""
import numpy as np
import pytest

from moebus.cuda.backends.cpu import CpuBackend
from moebus.workers.kv_cache import KVCache, resolve_kv_dtype
from moebus.workers.local import LocalModel


@pytest.mark.parametrize("kv_dtype, itemsize", [("bf16", 2), ("fp32", 4)])
def test_bytes_needed_is_what_the_cache_allocates(kv_dtype, itemsize):
    kv = KVCache(CpuBackend(), 3, 2, 4, 16, 8, kv_dtype)
    allocated = sum(a.nbytes for a in kv.k + kv.v)
    assert allocated == KVCache.bytes_needed(3, 2, 4, 16, 8, kv_dtype) == 2 * 3 * 2 * 4 * 16 * 8 * itemsize


def test_an_unknown_kv_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="fp16"):
        KVCache(CpuBackend(), 1, 1, 1, 4, 4, "fp16")


def test_auto_is_bf16_on_cuda_and_fp32_on_cpu():
    assert (resolve_kv_dtype("auto", "cuda"), resolve_kv_dtype("auto", "cpu")) == ("bf16", "fp32")
    assert resolve_kv_dtype("fp32", "cuda") == "fp32"


def test_a_bf16_cache_keeps_the_greedy_tokens_of_float32(tiny_model):
    prompt = [5, 17, 99, 3, 42, 7, 250]
    full = LocalModel(tiny_model, num_slots=2, max_context=64).generate(prompt, 12)
    half = LocalModel(tiny_model, num_slots=2, max_context=64, kv_dtype="bf16")
    assert half.stages[0].kv.k[0].dtype == np.uint16
    got = half.generate(prompt, 12)
    assert got.tokens == full.tokens
    assert np.abs(np.array(got.logprobs) - full.logprobs).max() < 0.05  # bf16 keys and values: ~1e-2
