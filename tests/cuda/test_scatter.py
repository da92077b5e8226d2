import numpy as np

from moebus.cuda.kernels.scatter import scatter_rows_cuda, scatter_rows_ref
from tests.cuda.conftest import device


def test_scatter_rows_replaces_only_the_given_rows(rng):
    x = rng.standard_normal((7, 12), dtype=np.float32)
    rows = np.array([5, 1, 2], np.int32)
    values = rng.standard_normal((3, 12), dtype=np.float32)
    target = device(x)
    scatter_rows_cuda(target, device(rows), device(values))
    expected = scatter_rows_ref(x.copy(), rows, values)
    np.testing.assert_array_equal(target.copy_to_host(), expected)
    np.testing.assert_array_equal(expected[[0, 3, 4, 6]], x[[0, 3, 4, 6]])
    np.testing.assert_array_equal(expected[rows], values)
