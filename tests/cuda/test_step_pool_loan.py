"""The prompt-path loan on the cuda backend: a step's new scratch buffers are carved from the lent
region, and none of them survives the loan."""
import numpy as np

from moebus.cuda.step_pool import StepPool


def test_new_buffers_come_from_the_lent_region_and_are_forgotten_after():
    allocated = []
    pool = StepPool(lambda shape, dtype: allocated.append(shape) or np.empty(shape, dtype))
    standing = pool.take((64,), np.float32)  # before the loan: a real allocation
    pool.recycle()
    region = np.zeros(8192, np.uint8)  # room for the 4 KiB class, not the 16 KiB one
    pool.lend(region)
    a = pool.take((64,), np.float32)  # the standing buffer is reused first
    b = pool.take((1000,), np.float32)  # new: carved from the region
    c = pool.take((3000,), np.float32)  # does not fit what is left: allocated
    assert a.base is standing.base or np.shares_memory(a, standing)
    assert np.shares_memory(b, region) and not np.shares_memory(c, region)
    pool.recycle()
    assert np.shares_memory(pool.take((1000,), np.float32), region)  # reused within the loan
    pool.end_loan()
    pool.recycle()
    for _ in range(4):  # a steady step after the loan: one new buffer, then reused
        assert not np.shares_memory(pool.take((1000,), np.float32), region)
        pool.recycle()
    assert len(allocated) == 1 + 1 + 1  # standing, c, and one new 4 KiB buffer after the loan
