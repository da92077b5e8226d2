import numpy as np

from moebus.cuda.kernels.elementwise import add_cuda, add_ref, fill_cuda, swiglu_cuda, swiglu_ref
from tests.cuda.conftest import device, poisoned


def test_add_matches_ref(rng):
    x, y = (rng.standard_normal((3, 70), dtype=np.float32) for _ in range(2))
    out = poisoned((3, 70))
    add_cuda(device(x), device(y), out)
    np.testing.assert_array_equal(out.copy_to_host(), add_ref(x, y))


def test_swiglu_matches_ref(rng):
    gate, up = (rng.standard_normal((2, 50), dtype=np.float32) * 4 for _ in range(2))
    out = poisoned((2, 50))
    swiglu_cuda(device(gate), device(up), out)
    np.testing.assert_allclose(out.copy_to_host(), swiglu_ref(gate, up), rtol=1e-5, atol=1e-6)


def test_fill_sets_every_element():
    out = poisoned((3, 5, 7))
    fill_cuda(out, 0)
    np.testing.assert_array_equal(out.copy_to_host(), 0)
    ids = poisoned((9,), np.int32)
    fill_cuda(ids, 7)
    np.testing.assert_array_equal(ids.copy_to_host(), 7)
