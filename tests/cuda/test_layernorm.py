import numpy as np
import pytest

from moebus.cuda.kernels.layernorm import layernorm_cuda, layernorm_ref
from tests.cuda.conftest import STORAGES, device, poisoned, stored


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("rows, dim", [(3, 40), (6, 16)])
def test_layernorm_matches_ref(rng, storage, rows, dim):
    x = rng.standard_normal((rows, dim), dtype=np.float32) * 3 + 5  # an offset: the mean matters
    weight = stored(1 + 0.1 * rng.standard_normal(dim, dtype=np.float32), storage)
    bias = stored(0.1 * rng.standard_normal(dim, dtype=np.float32), storage)
    out = poisoned((rows, dim))
    layernorm_cuda(device(x), device(weight), device(bias), 1e-5, out)
    np.testing.assert_allclose(out.copy_to_host(), layernorm_ref(x, weight, bias, 1e-5), rtol=1e-5, atol=1e-5)


def test_layernorm_ref_matches_torch(rng):
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((4, 24), dtype=np.float32) * 2
    weight, bias = rng.standard_normal(24, dtype=np.float32), rng.standard_normal(24, dtype=np.float32)
    ref = torch.nn.functional.layer_norm(torch.tensor(x), (24,), torch.tensor(weight), torch.tensor(bias), 1e-6)
    np.testing.assert_allclose(layernorm_ref(x, weight, bias, 1e-6), ref.numpy(), rtol=1e-5, atol=1e-5)


def test_layernorm_rejects_a_bias_of_another_length():
    with pytest.raises(ValueError, match="bias"):
        layernorm_cuda(device(np.zeros((2, 8), np.float32)), device(np.ones(8, np.float32)),
                       device(np.zeros(4, np.float32)), 1e-6, poisoned((2, 8)))


@pytest.mark.parametrize("parts", [0, 2])  # 0: a float32 result; 2: a product's split input
def test_residual_layernorm_is_bias_residual_then_layernorm_bit_for_bit(rng, parts):
    """One pass (the residual add of a product, then the next norm) equals the two kernels it
    replaces bit for bit; 7 rows over blocks of 4 warps: a warp past the last row stores nothing;
    a width of 170: the last group of four elements a lane reads runs past the row."""
    from moebus.cuda.kernels.gemm import split_rows_cuda
    from moebus.cuda.kernels.layernorm import residual_layernorm_cuda, residual_layernorm_ref
    from moebus.cuda.kernels.tiled_linear import bias_residual_cuda

    rows, dim = 7, 170
    x = rng.standard_normal((rows, dim), dtype=np.float32) * 3 + 2
    y = rng.standard_normal((rows, dim), dtype=np.float32)
    residual_bias, weight, bias = (stored(rng.standard_normal(dim, dtype=np.float32), "bf16") for _ in range(3))
    x_out, out = poisoned((rows, dim)), device(np.full((parts, rows, dim), 0xFFFF, np.uint16)) if parts else \
        poisoned((rows, dim))
    residual_layernorm_cuda(device(x), device(y), device(residual_bias), device(weight), device(bias), 1e-6, x_out, out)
    summed = bias_residual_cuda(device(x), device(y), device(residual_bias), poisoned((rows, dim)))
    normed = layernorm_cuda(summed, device(weight), device(bias), 1e-6, poisoned((rows, dim)))
    if parts:
        normed = split_rows_cuda(normed, device(np.zeros((parts, rows, dim), np.uint16)))
    np.testing.assert_array_equal(x_out.copy_to_host(), summed.copy_to_host())
    np.testing.assert_array_equal(out.copy_to_host(), normed.copy_to_host())
    want_x, want = residual_layernorm_ref(x, y, residual_bias, weight, bias, 1e-6)
    np.testing.assert_array_equal(x_out.copy_to_host(), want_x)
    if not parts:
        np.testing.assert_allclose(out.copy_to_host(), want, rtol=1e-5, atol=1e-5)
