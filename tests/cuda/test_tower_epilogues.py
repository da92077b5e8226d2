"""A product's bias added by the op that reads the product next (tiled_linear.bias_activation and
bias_residual, mrope's bias): against their numpy references, and the references against the unfused
ops they replace in the Qwen3-VL tower (bit for bit: the same float32 additions in the same order)."""
import numpy as np
import pytest

from moebus.cuda.dtypes import to_f32
from moebus.cuda.kernels.activations import activation_ref
from moebus.cuda.kernels.elementwise import add_ref
from moebus.cuda.kernels.mrope import mrope_cuda, mrope_ref, vision_axes, vision_rope_tables
from moebus.cuda.kernels.tiled_linear import (bias_activation_cuda, bias_activation_ref, bias_residual_cuda,
                                              bias_residual_ref, tiled_linear_ref)
from tests.cuda.conftest import STORAGES, device, poisoned, stored


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("name", ["gelu_pytorch_tanh", "gelu"])
def test_bias_activation_matches_ref(rng, storage, name):
    y = rng.standard_normal((5, 37), dtype=np.float32)  # rows longer than the simulator's block
    bias = stored(rng.standard_normal(37, dtype=np.float32), storage)
    out = poisoned(y.shape)
    bias_activation_cuda(device(y), device(bias), name, out)
    np.testing.assert_allclose(out.copy_to_host(), bias_activation_ref(y, bias, name), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("storage", STORAGES)
def test_bias_residual_matches_ref(rng, storage):
    x, y = rng.standard_normal((2, 6, 37), dtype=np.float32)
    bias = stored(rng.standard_normal(37, dtype=np.float32), storage)
    out = poisoned(y.shape)
    bias_residual_cuda(device(x), device(y), device(bias), out)
    np.testing.assert_array_equal(out.copy_to_host(), bias_residual_ref(x, y, bias))


@pytest.mark.parametrize("storage", STORAGES)
def test_mrope_with_a_bias_matches_ref(rng, storage):
    cos, sin = vision_rope_tables(16, 10000.0, 40)
    x = rng.standard_normal((6, 3, 16), dtype=np.float32)
    bias = stored(rng.standard_normal(3 * 16, dtype=np.float32), storage)
    positions = rng.integers(0, 40, (6, 2)).astype(np.int32)
    out = poisoned(x.shape)
    mrope_cuda(device(x), device(positions), device(vision_axes(16)), device(cos), device(sin), out,
               bias=device(bias))
    want = mrope_ref(x, positions, vision_axes(16), cos, sin, bias)
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=1e-5, atol=1e-5)
    unbiased = mrope_ref(x + to_f32(bias).reshape(3, 16), positions, vision_axes(16), cos, sin)
    np.testing.assert_array_equal(want, unbiased)


def test_the_references_equal_the_ops_they_replace(rng):
    """On cpu the tower's results do not move: product with bias, then the op, as before."""
    h = rng.standard_normal((7, 12), dtype=np.float32)
    x = rng.standard_normal((7, 10), dtype=np.float32)
    weight, bias = rng.standard_normal((10, 12), dtype=np.float32), rng.standard_normal(10, dtype=np.float32)
    product = tiled_linear_ref(h, weight)
    np.testing.assert_array_equal(bias_residual_ref(x, product, bias), add_ref(x, tiled_linear_ref(h, weight, bias)))
    np.testing.assert_array_equal(bias_activation_ref(product, bias, "gelu_pytorch_tanh"),
                                  activation_ref(tiled_linear_ref(h, weight, bias), "gelu_pytorch_tanh"))


def test_bad_shapes_and_names_are_refused():
    y, bias = device(np.zeros((2, 4), np.float32)), device(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="bias"):
        bias_residual_cuda(y, y, bias, poisoned((2, 4)))
    with pytest.raises(ValueError, match="unknown activation"):
        bias_activation_cuda(y, device(np.zeros(4, np.float32)), "swish", poisoned((2, 4)))
    with pytest.raises(ValueError, match="bias"):
        cos, sin = vision_rope_tables(4, 10000.0, 4)
        mrope_cuda(device(np.zeros((1, 2, 4), np.float32)), device(np.zeros((1, 2), np.int32)),
                   device(vision_axes(4)), device(cos), device(sin), poisoned((1, 2, 4)), bias=bias)
