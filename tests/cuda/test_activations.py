import numpy as np
import pytest

from moebus.cuda.kernels.activations import REFS, activation_cuda, activation_ref, add_bias_cuda, add_bias_ref
from tests.cuda.conftest import STORAGES, device, poisoned, stored


@pytest.mark.parametrize("name", sorted(REFS))
def test_activation_matches_ref(rng, name):
    x = rng.standard_normal((3, 37), dtype=np.float32) * 4
    out = poisoned((3, 37))
    activation_cuda(device(x), name, out)
    np.testing.assert_allclose(out.copy_to_host(), activation_ref(x, name), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name, torch_name", [("gelu", "gelu"), ("gelu_pytorch_tanh", "gelu_pytorch_tanh"),
                                              ("quick_gelu", "quick_gelu")])
def test_activation_ref_matches_transformers(rng, name, torch_name):
    torch = pytest.importorskip("torch")
    from transformers.activations import ACT2FN

    x = rng.standard_normal(200, dtype=np.float32) * 4
    np.testing.assert_allclose(activation_ref(x, name), ACT2FN[torch_name](torch.tensor(x)).numpy(),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("table_rows", [1, 3])
def test_add_bias_broadcasts_rows(rng, storage, table_rows):
    x = rng.standard_normal((6, 20), dtype=np.float32)
    bias = stored(rng.standard_normal((table_rows, 20), dtype=np.float32), storage)
    out = poisoned((6, 20))
    add_bias_cuda(device(x), device(bias[0] if table_rows == 1 else bias), out)
    np.testing.assert_array_equal(out.copy_to_host(), add_bias_ref(x, bias))


def test_add_bias_rejects_a_table_that_does_not_divide_the_rows():
    with pytest.raises(ValueError, match="bias"):
        add_bias_cuda(device(np.zeros((5, 4), np.float32)), device(np.zeros((2, 4), np.float32)), poisoned((5, 4)))
