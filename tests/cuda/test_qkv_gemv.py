import numpy as np
import pytest
from moebus.cuda.dtypes import f32_to_bf16

from moebus.cuda.kernels.fused import qkv_rope_store_cuda, qkv_rope_store_ref
from moebus.cuda.kernels.linear import linear_cuda, linear_ref
from moebus.cuda.kernels.qkv_gemv import qkv_gemv_rope_cuda, work_shape
from moebus.cuda.kernels.rope import rope_tables
from tests.cuda.conftest import device, poisoned, stored


def _case(rng, kv_dtype, heads=2, kv_heads=1, hd=64, dim=128):
    x = rng.standard_normal((1, dim), dtype=np.float32)
    weight = stored(rng.standard_normal(((heads + 2 * kv_heads) * hd, dim), dtype=np.float32) * 0.1, "bf16")
    q_weight, k_weight = (stored(rng.standard_normal(hd, dtype=np.float32), "bf16") for _ in range(2))
    cos, sin = rope_tables(hd, 10000.0, 16)
    caches = [rng.standard_normal((2, kv_heads, 16, hd), dtype=np.float32) for _ in range(2)]
    if kv_dtype == "bf16":
        caches = [f32_to_bf16(c) for c in caches]
    return x, weight, q_weight, k_weight, cos, sin, caches, (heads, kv_heads, hd)


@pytest.mark.parametrize("kv_dtype, dim", [("fp32", 128), ("bf16", 128), ("bf16", 1024)])
def test_qkv_gemv_rope_gives_the_bits_of_linear_then_qkv_rope_store(rng, kv_dtype, dim):
    # the projection and the heads' tail in one launch: q, qkv and both caches equal the two kernels' bit for
    # bit, twice with one set of counters (each head's last block resets its counter), and near numpy;
    # 1024 wide: a row's words over two warps (linear's split)
    x, weight, q_weight, k_weight, cos, sin, caches, (heads, kv_heads, hd) = _case(rng, kv_dtype, dim=dim)
    slots, positions = np.array([1], np.int32), np.array([5], np.int32)
    args = [device(a) for a in (q_weight, k_weight)]
    tables = [device(a) for a in (slots, positions, cos, sin)]
    two_k, two_v = device(caches[0]), device(caches[1])
    qkv_two = linear_cuda(device(x), device(weight), poisoned((1, weight.shape[0])))
    q_two = qkv_rope_store_cuda(qkv_two, heads, kv_heads, *args, 1e-6, *tables, two_k, two_v,
                                poisoned((1, heads, hd)))
    done = device(np.zeros(8, np.int32))
    one_k, one_v = device(caches[0]), device(caches[1])
    for _ in range(2):
        qkv_one, q_one = poisoned((1, weight.shape[0])), poisoned((1, heads, hd))
        assert qkv_gemv_rope_cuda(device(x), device(weight), heads, kv_heads, *args, 1e-6, *tables, one_k, one_v,
                                  done, qkv_one, q_one)
        assert not done.copy_to_host().any()
        np.testing.assert_array_equal(qkv_one.copy_to_host(), qkv_two.copy_to_host())
        np.testing.assert_array_equal(q_one.copy_to_host(), q_two.copy_to_host())
        np.testing.assert_array_equal(one_k.copy_to_host(), two_k.copy_to_host())
        np.testing.assert_array_equal(one_v.copy_to_host(), two_v.copy_to_host())
    want_k, want_v = caches[0].copy(), caches[1].copy()
    want_q = qkv_rope_store_ref(linear_ref(x, weight), heads, kv_heads, q_weight, k_weight, 1e-6, slots, positions,
                                cos, sin, want_k, want_v)
    np.testing.assert_allclose(q_one.copy_to_host(), want_q, rtol=1e-4, atol=1e-4)


def test_qkv_gemv_rope_declines_what_it_does_not_take(rng):
    # two tokens, or f32 weights (no wide words): nothing launched, the backend runs the two kernels
    x, weight, q_weight, k_weight, cos, sin, caches, (heads, kv_heads, hd) = _case(rng, "fp32")
    rest = (heads, kv_heads, device(q_weight), device(k_weight), 1e-6, device(np.zeros(2, np.int32)),
            device(np.zeros(2, np.int32)), device(cos), device(sin), device(caches[0]), device(caches[1]),
            device(np.zeros(8, np.int32)))
    two = np.concatenate([x, x])
    assert not qkv_gemv_rope_cuda(device(two), device(weight), *rest, poisoned((2, 256)), poisoned((2, heads, hd)))
    f32 = weight.astype(np.float32) if weight.dtype != np.uint16 else np.ones(weight.shape, np.float32)
    assert not qkv_gemv_rope_cuda(device(x), device(f32), *rest, poisoned((1, 256)), poisoned((1, heads, hd)))


def test_work_shape_keeps_a_block_within_a_head():
    # A3B at batch 1 on a GPU: 5120 rows of 512 words, 4 warps: split 2, 4 words a lane, 4 rows a warp
    assert work_shape(5120, 512, 128, 128) == (2, 4, 4)
    assert work_shape(5120, 512, 4, 128) is None  # 8 rows a block, heads of 4


def test_a_decode_with_the_fused_projection_gives_the_bits_of_the_two_kernels(tmp_path_factory, monkeypatch):
    # a micro model with 64-wide heads (the fused kernels take multiples of 64): greedy tokens and log p with
    # qkv_gemv.ENABLED equal those without, and the one-token steps took the fused kernel
    from moebus.cuda.kernels import qkv_gemv
    from moebus.workers.local import LocalModel
    from tests.cuda.test_e2e import init_micro

    model_dir = init_micro(tmp_path_factory, preset="micro64", head_dim=64)
    runs, launched = [], []
    fused = qkv_gemv.qkv_gemv_rope_cuda
    monkeypatch.setattr(qkv_gemv, "qkv_gemv_rope_cuda", lambda *a, **k: launched.append(fused(*a, **k)) or launched[-1])
    for enabled in (False, True):
        monkeypatch.setattr(qkv_gemv, "ENABLED", enabled)
        runs.append(LocalModel(model_dir, device="cuda", max_context=32).generate([5, 17, 42, 9, 77], 3))
    assert runs[1].tokens == runs[0].tokens
    np.testing.assert_array_equal(runs[1].logprobs, runs[0].logprobs)
    assert launched.count(True) == 2 * 2  # two decode steps after the prompt, two layers
