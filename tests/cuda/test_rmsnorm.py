import numpy as np
import pytest

from moebus.cuda.kernels.rmsnorm import rmsnorm_cuda, rmsnorm_ref
from tests.cuda.conftest import STORAGES, device, poisoned, stored


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("rows, dim", [(3, 40), (5, 16)])
def test_rmsnorm_matches_ref(rng, storage, rows, dim):
    x = rng.standard_normal((rows, dim), dtype=np.float32) * 3
    weight = stored(1 + 0.1 * rng.standard_normal(dim, dtype=np.float32), storage)
    out = poisoned((rows, dim))
    rmsnorm_cuda(device(x), device(weight), 1e-6, out)
    np.testing.assert_allclose(out.copy_to_host(), rmsnorm_ref(x, weight, 1e-6), rtol=1e-5, atol=1e-6)


def test_rmsnorm_rejects_wrong_weight_length():
    with pytest.raises(ValueError, match="weight"):
        rmsnorm_cuda(device(np.zeros((2, 8), np.float32)), device(np.zeros(4, np.float32)), 1e-6,
                     poisoned((2, 8)))


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("rows, dim", [(2, 600), (3, 40)])
def test_wide_rmsnorm_rows_match_ref(rng, monkeypatch, storage, rows, dim):
    # a block per row (a hidden-wide norm); 40 wide with the threshold lowered: more threads than elements
    from moebus.cuda.kernels import rmsnorm

    monkeypatch.setattr(rmsnorm, "WIDE_ROW", 32)
    x = rng.standard_normal((rows, dim), dtype=np.float32)
    weight = stored(rng.standard_normal(dim, dtype=np.float32), storage)
    out = poisoned((rows, dim))
    rmsnorm_cuda(device(x), device(weight), 1e-6, out)
    np.testing.assert_allclose(out.copy_to_host(), rmsnorm_ref(x, weight, 1e-6), rtol=1e-5, atol=1e-5)
