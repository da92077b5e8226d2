import numpy as np
import pytest
from moebus.cuda.dtypes import f32_to_bf16, to_f32

from moebus.cuda.kernels.fused import (add_rmsnorm_cuda, add_rmsnorm_ref, combine_add_rmsnorm_cuda, combine_add_rmsnorm_ref,
                               qkv_rope_store_cuda, qkv_rope_store_ref)
from moebus.cuda.kernels.rope import rope_tables
from tests.cuda.conftest import STORAGES, device, poisoned, stored


@pytest.mark.parametrize("storage", STORAGES)
def test_add_rmsnorm_matches_the_add_then_the_norm(rng, storage):
    x, y = rng.standard_normal((3, 200), dtype=np.float32), rng.standard_normal((3, 200), dtype=np.float32)
    weight = stored(rng.standard_normal(200, dtype=np.float32), storage)
    total, out = poisoned((3, 200)), poisoned((3, 200))
    add_rmsnorm_cuda(device(x), device(y), device(weight), 1e-6, total, out)
    want_total, want_out = add_rmsnorm_ref(x, y, weight, 1e-6)
    np.testing.assert_array_equal(total.copy_to_host(), want_total)
    np.testing.assert_allclose(out.copy_to_host(), want_out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("storage", ("bf16", "f32"))
def test_combine_add_rmsnorm_matches_combine_then_add_then_norm(rng, storage):
    y_pair, weights = rng.standard_normal((6, 96), dtype=np.float32), rng.random((3, 2), dtype=np.float32)
    x = rng.standard_normal((3, 96), dtype=np.float32)
    weight = stored(rng.standard_normal(96, dtype=np.float32), storage)
    total, out = poisoned((3, 96)), poisoned((3, 96))
    combine_add_rmsnorm_cuda(device(y_pair), device(weights), device(x), device(weight), 1e-6, total, out)
    want_total, want_out = combine_add_rmsnorm_ref(y_pair, weights, x, weight, 1e-6)
    np.testing.assert_allclose(total.copy_to_host(), want_total, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out.copy_to_host(), want_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("storage, kv_dtype", [("bf16", "fp32"), ("f32", "fp32"), ("bf16", "bf16")])
def test_qkv_rope_store_matches_norm_rope_and_kv_store(rng, storage, kv_dtype):
    heads, kv_heads, hd = 4, 2, 64
    qkv = rng.standard_normal((2, (heads + 2 * kv_heads) * hd), dtype=np.float32)
    q_weight, k_weight = (stored(rng.standard_normal(hd, dtype=np.float32), storage) for _ in range(2))
    cos, sin = rope_tables(hd, 10000.0, 16)
    slots, positions = np.array([1, 0], np.int32), np.array([3, 11], np.int32)
    k_cache, v_cache = (rng.standard_normal((2, kv_heads, 16, hd), dtype=np.float32) for _ in range(2))
    if kv_dtype == "bf16":
        k_cache, v_cache = f32_to_bf16(k_cache), f32_to_bf16(v_cache)
    want_k, want_v = k_cache.copy(), v_cache.copy()
    want_q = qkv_rope_store_ref(qkv, heads, kv_heads, q_weight, k_weight, 1e-6, slots, positions, cos, sin,
                                want_k, want_v)
    dev_k, dev_v, q = device(k_cache), device(v_cache), poisoned((2, heads, hd))
    qkv_rope_store_cuda(device(qkv), heads, kv_heads, device(q_weight), device(k_weight), 1e-6, device(slots),
                        device(positions), device(cos), device(sin), dev_k, dev_v, q)
    np.testing.assert_allclose(q.copy_to_host(), want_q, rtol=1e-5, atol=1e-5)
    # untouched rows too; a bf16 cache may round a last-bit difference of the float32 value either way
    tolerance = 2.0**-7 if kv_dtype == "bf16" else 1e-5
    np.testing.assert_allclose(to_f32(dev_k.copy_to_host()), to_f32(want_k), rtol=tolerance, atol=1e-5)
    np.testing.assert_array_equal(dev_v.copy_to_host(), want_v)
