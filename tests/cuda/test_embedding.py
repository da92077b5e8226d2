import numpy as np
import pytest

from moebus.cuda.kernels.embedding import embedding_cuda, embedding_ref
from tests.cuda.conftest import STORAGES, device, poisoned, stored


@pytest.mark.parametrize("storage", STORAGES)
def test_embedding_gathers_rows(rng, storage):
    table = stored(rng.standard_normal((11, 24), dtype=np.float32), storage)
    ids = np.array([3, 0, 10, 3], np.int32)
    out = poisoned((4, 24))
    embedding_cuda(device(table), device(ids), out)
    np.testing.assert_array_equal(out.copy_to_host(), embedding_ref(table, ids))


def test_embedding_of_float32_rows_is_exact(rng):
    hidden = rng.standard_normal((5, 8), dtype=np.float32)  # the stage's last-token gather
    ids = np.array([4, 1], np.int32)
    out = poisoned((2, 8))
    embedding_cuda(device(hidden), device(ids), out)
    np.testing.assert_array_equal(out.copy_to_host(), hidden[ids])


def test_embedding_out_of_range_id_gives_nan_row_not_a_fault(rng):
    table = rng.standard_normal((4, 8), dtype=np.float32)
    out = poisoned((2, 8))
    embedding_cuda(device(table), device(np.array([1, 4], np.int32)), out)
    host = out.copy_to_host()
    np.testing.assert_array_equal(host[0], table[1])
    assert np.isnan(host[1]).all()
