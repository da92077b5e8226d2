import numpy as np
import pytest

from moebus.cuda.kernels.mrope import (mrope_axes, mrope_cuda, mrope_ref, vision_axes, vision_rope_tables)
from moebus.cuda.kernels.rope import rope_ref, rope_tables
from moebus.cuda.kernels.weighted_rows import weighted_rows_cuda, weighted_rows_ref
from tests.cuda.conftest import STORAGES, device, poisoned, stored


def test_mrope_axes_interleave_height_and_width():
    # mrope_section (t, h, w) = (4, 2, 2) over 8 frequencies: h at 1, 4; w at 2, 5; t elsewhere
    assert mrope_axes(16, (4, 2, 2)).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    assert vision_axes(16).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_equal_positions_are_plain_rope(rng):
    cos, sin = rope_tables(16, 10000.0, 32)
    x = rng.standard_normal((5, 2, 16), dtype=np.float32)
    pos = np.array([0, 3, 9, 17, 31], np.int32)
    out = mrope_ref(x, np.repeat(pos[:, None], 3, axis=1), mrope_axes(16, (4, 2, 2)), cos, sin)
    np.testing.assert_array_equal(out, rope_ref(x, pos, cos, sin))


@pytest.mark.parametrize("kind", ["text", "vision"])
def test_mrope_matches_ref(rng, kind):
    if kind == "text":
        cos, sin = rope_tables(16, 10000.0, 40)
        axes, num_axes = mrope_axes(16, (4, 2, 2)), 3
    else:
        cos, sin = vision_rope_tables(16, 10000.0, 40)
        axes, num_axes = vision_axes(16), 2
    x = rng.standard_normal((6, 3, 16), dtype=np.float32)
    positions = rng.integers(0, 40, (6, num_axes)).astype(np.int32)
    out = poisoned(x.shape)
    mrope_cuda(device(x), device(positions), device(axes), device(cos), device(sin), out)
    np.testing.assert_allclose(out.copy_to_host(), mrope_ref(x, positions, axes, cos, sin), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("storage", STORAGES)
def test_weighted_rows_matches_ref(rng, storage):
    table = stored(rng.standard_normal((16, 40), dtype=np.float32), storage)
    indices = rng.integers(0, 16, (7, 4)).astype(np.int32)
    weights = rng.random((7, 4), dtype=np.float32)
    out = poisoned((7, 40))
    weighted_rows_cuda(device(table), device(indices), device(weights), out)
    np.testing.assert_allclose(out.copy_to_host(), weighted_rows_ref(table, indices, weights), rtol=1e-5, atol=1e-5)
