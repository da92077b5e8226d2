"""The two-part bias + activation kernel with unsigned columns (split_two_parts.py) equals
split_epilogues.py's paired kernel bit for bit, and so the unfused op then split_rows."""
import numpy as np
import pytest

from moebus.cuda.dtypes import f32_to_bf16
from moebus.cuda.kernels import split_two_parts
from moebus.cuda.kernels.split_epilogues import bias_activation_split_cuda
from tests.cuda.conftest import device


@pytest.mark.parametrize("name", ["gelu_pytorch_tanh", "gelu"])
@pytest.mark.parametrize("dim", [2, 150, 256])  # 150: a pair past 32 threads x 2 pairs (the clamped second pair)
def test_two_parts_equal_the_paired_kernel(rng, monkeypatch, name, dim):
    y = rng.standard_normal((5, dim), dtype=np.float32) * 3
    bias = device(f32_to_bf16(rng.standard_normal(dim, dtype=np.float32)))
    results = []
    for two in (False, True):
        monkeypatch.setattr(split_two_parts, "TWO_PARTS", two)
        out = device(np.full((2, 5, dim), 0xFFFF, np.uint16))
        results.append(bias_activation_split_cuda(device(y), bias, name, out).copy_to_host())
    np.testing.assert_array_equal(results[1], results[0])


def test_one_part_keeps_the_paired_kernel(rng, monkeypatch):
    monkeypatch.setattr(split_two_parts, "TWO_PARTS", True)
    y = rng.standard_normal((3, 8), dtype=np.float32)
    bias = device(f32_to_bf16(np.zeros(8, np.float32)))
    got = bias_activation_split_cuda(device(y), bias, "gelu", device(np.zeros((1, 3, 8), np.uint16))).copy_to_host()
    assert got.shape == (1, 3, 8) and got.any()
