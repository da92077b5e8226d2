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
