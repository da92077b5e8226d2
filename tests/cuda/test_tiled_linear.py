import numpy as np
import pytest

from moebus.cuda.kernels.tiled_linear import tiled_linear_cuda, tiled_linear_ref
from tests.cuda.conftest import STORAGES, device, poisoned, stored


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("rows, dim_in, dim_out, with_bias", [(19, 13, 21, True), (8, 16, 8, False), (1, 5, 3, True)])
def test_tiled_linear_matches_ref(rng, storage, rows, dim_in, dim_out, with_bias):
    # shapes that cut the tile in every direction (and k not a multiple of the slab)
    x = rng.standard_normal((rows, dim_in), dtype=np.float32)
    weight = stored(rng.standard_normal((dim_out, dim_in), dtype=np.float32), storage)
    bias = stored(rng.standard_normal(dim_out, dtype=np.float32), storage) if with_bias else None
    out = poisoned((rows, dim_out))
    tiled_linear_cuda(device(x), device(weight), None if bias is None else device(bias), out)
    np.testing.assert_allclose(out.copy_to_host(), tiled_linear_ref(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_a_row_does_not_depend_on_the_others(rng):
    x = rng.standard_normal((12, 9), dtype=np.float32)
    weight = rng.standard_normal((10, 9), dtype=np.float32)
    full, part = poisoned((12, 10)), poisoned((3, 10))
    tiled_linear_cuda(device(x), device(weight), None, full)
    tiled_linear_cuda(device(x[5:8]), device(weight), None, part)
    np.testing.assert_array_equal(full.copy_to_host()[5:8], part.copy_to_host())


def test_tiled_linear_rejects_a_bias_of_another_length():
    with pytest.raises(ValueError, match="bias"):
        tiled_linear_cuda(device(np.zeros((2, 4), np.float32)), device(np.zeros((3, 4), np.float32)),
                          device(np.zeros(2, np.float32)), poisoned((2, 3)))


def test_the_gpu_tile_gives_the_same_result(rng, monkeypatch):
    from moebus.cuda.kernels import tiled_linear

    monkeypatch.setattr(tiled_linear, "TILE", (64, 64, 16, 4, 4))  # what a real GPU runs
    x = rng.standard_normal((66, 20), dtype=np.float32)
    weight = stored(rng.standard_normal((70, 20), dtype=np.float32), "bf16")
    bias = stored(rng.standard_normal(70, dtype=np.float32), "bf16")
    out = poisoned((66, 70))
    tiled_linear_cuda(device(x), device(weight), device(bias), out)
    np.testing.assert_allclose(out.copy_to_host(), tiled_linear_ref(x, weight, bias), rtol=1e-5, atol=1e-5)
