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


@pytest.mark.parametrize("storage", STORAGES)
def test_embedding_of_a_row_wider_than_a_blocks_loads_in_flight(rng, storage):
    """700 columns: on a GPU 512 threads, some with a second load in flight; in the simulator 64
    threads, 256 columns an iteration, the last one partly (every tail of the four loads)."""
    table = stored(rng.standard_normal((9, 700), dtype=np.float32), storage)
    ids = np.array([8, 2, 99, 2, 0], np.int32)
    out = poisoned((5, 700))
    embedding_cuda(device(table), device(ids), out)
    host = out.copy_to_host()
    np.testing.assert_array_equal(host[[0, 1, 3, 4]], embedding_ref(table, ids[[0, 1, 3, 4]]))
    assert np.isnan(host[2]).all()  # out of range


def test_the_backend_keeps_the_token_embedding_in_mapped_host_memory(rng, monkeypatch):
    """CudaBackend.token_table: the table is pinned host memory the gather reads in place (no device
    copy: its VRAM goes to the expert cache); MOEBUS_EMBEDDING_VRAM=1 makes a device copy."""
    from moebus.cuda.backends.cuda import CudaBackend
    from moebus.cuda.kernels.compat import SIMULATOR

    backend = CudaBackend()
    table = stored(rng.standard_normal((33, 300), dtype=np.float32), "bf16")
    ids = np.array([32, 0, 7], np.int32)
    mapped = backend.token_table(table)
    if SIMULATOR:
        assert isinstance(mapped, np.ndarray) and not hasattr(mapped, "copy_to_host")  # a host array
    else:
        from numba.cuda.cudadrv.devicearray import MappedNDArray

        assert isinstance(mapped.gpu_data.owner, MappedNDArray)  # a device view of mapped host memory
    np.testing.assert_array_equal(backend.to_host(backend.embedding(mapped, backend.upload(ids))),
                                  embedding_ref(table, ids))
    monkeypatch.setenv("MOEBUS_EMBEDDING_VRAM", "1")
    copied = backend.token_table(table)
    assert hasattr(copied, "copy_to_host")  # a device array
    np.testing.assert_array_equal(backend.to_host(backend.embedding(copied, backend.upload(ids))),
                                  embedding_ref(table, ids))
    monkeypatch.setenv("MOEBUS_EMBEDDING_VRAM", "yes")
    from moebus.common.errors import ConfigError

    with pytest.raises(ConfigError, match="MOEBUS_EMBEDDING_VRAM='yes': 1 keeps"):
        backend.token_table(table)
