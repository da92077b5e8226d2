import numpy as np
import pytest

from moebus.cuda.fused import add_rmsnorm_cuda, add_rmsnorm_ref, head_norm_rope_cuda, head_norm_rope_ref
from moebus.cuda.rope import rope_tables
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
def test_head_norm_rope_matches_the_norm_then_rope(rng, storage):
    x = rng.standard_normal((2, 3, 64), dtype=np.float32)
    weight = stored(rng.standard_normal(64, dtype=np.float32), storage)
    cos, sin = rope_tables(64, 10000.0, 16)
    positions = np.array([3, 11], np.int32)
    out = poisoned(x.shape)
    head_norm_rope_cuda(device(x), device(weight), 1e-6, device(positions), device(cos), device(sin), out)
    np.testing.assert_allclose(out.copy_to_host(), head_norm_rope_ref(x, weight, 1e-6, positions, cos, sin),
                               rtol=1e-5, atol=1e-5)
