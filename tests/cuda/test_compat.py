"""The simulator side of compat: bit casts, and the warp/block reductions (both the simulator's
own block reductions and the tree versions the GPU runs)."""
import numpy as np
import pytest

from moebus.cuda.kernels import compat
from moebus.cuda.kernels.compat import cuda
from tests.cuda.conftest import device, poisoned


@pytest.mark.skipif(not compat.SIMULATOR, reason="a device function on the GPU")
def test_bits_as_f32_reinterprets_low_32_bits():
    values = np.array([1.5, -2.25, 3e-39, np.inf], np.float32)
    for v, bits in zip(values, values.view(np.uint32)):
        assert compat.bits_as_f32(int(bits) | (7 << 32)).tobytes() == v.tobytes()


@cuda.jit
def _reduce_kernel(values, sums, maxes, arg_values, arg_ids, tree_sums, tree_maxes, tree_ids):
    tid = cuda.threadIdx.x
    v = values[tid]
    sums[tid] = compat.block_sum(v) + compat.warp_sum(v) * 0  # both kinds in one kernel
    maxes[tid] = compat.block_max(v)
    arg_values[tid], arg_ids[tid] = compat.block_argmax(v, tid)
    tree_sums[tid] = compat.tree_block_sum(v)
    tree_maxes[tid] = compat.tree_block_max(v)
    _, tree_ids[tid] = compat.tree_block_argmax(v, tid)


@pytest.mark.parametrize("num_threads", [32, 64])
def test_block_reductions_agree_in_every_thread(rng, num_threads):
    values = rng.integers(-8, 8, num_threads).astype(np.float32)  # ties for argmax, exact sums
    sums, maxes, arg_values, tree_sums, tree_maxes = (poisoned(num_threads) for _ in range(5))
    arg_ids, tree_ids = poisoned(num_threads, np.int64), poisoned(num_threads, np.int64)
    _reduce_kernel[1, num_threads](device(values), sums, maxes, arg_values, arg_ids, tree_sums, tree_maxes,
                                   tree_ids)
    first_max = int(np.argmax(values))
    np.testing.assert_array_equal(sums.copy_to_host(), values.sum())
    np.testing.assert_array_equal(tree_sums.copy_to_host(), values.sum())
    np.testing.assert_array_equal(maxes.copy_to_host(), values.max())
    np.testing.assert_array_equal(tree_maxes.copy_to_host(), values.max())
    np.testing.assert_array_equal(arg_values.copy_to_host(), values.max())
    np.testing.assert_array_equal(arg_ids.copy_to_host(), first_max)
    np.testing.assert_array_equal(tree_ids.copy_to_host(), first_max)


@cuda.jit
def _warp_kernel(values, sums, many):
    tid = cuda.threadIdx.x
    sums[tid] = compat.warp_sum(values[tid])
    acc = cuda.local.array(3, compat.float32)
    for i in range(3):
        acc[i] = values[tid] * (i + 1)
    compat.warp_sum_many(acc, 3)
    for i in range(3):
        many[tid, i] = acc[i]


def test_warp_reductions_stay_within_each_warp(rng):
    values = rng.integers(-5, 5, 64).astype(np.float32)
    sums, many = poisoned(64), poisoned((64, 3))
    _warp_kernel[1, 64](device(values), sums, many)
    per_warp = values.reshape(2, 32).sum(axis=1)
    np.testing.assert_array_equal(sums.copy_to_host(), np.repeat(per_warp, 32))
    np.testing.assert_array_equal(many.copy_to_host(), np.repeat(per_warp, 32)[:, None] * [1, 2, 3])
