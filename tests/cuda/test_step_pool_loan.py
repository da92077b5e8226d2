"""The prompt-path loan on the cuda backend: a step's new scratch buffers are carved from the lent
region, and none of them survives the loan."""
import numpy as np

from moebus.cuda.memory.step_pool import StepPool


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


def test_the_pool_reports_its_peak_bytes_and_what_it_gives_back():
    pool = StepPool(lambda shape, dtype: np.empty(shape, dtype))
    pool.take((1000,), np.float32)  # 4000 bytes -> the 4 KiB class
    pool.take((10,), np.float32)  # the 256-byte class
    assert pool.allocated_bytes == pool.peak_bytes == 4096 + 256
    pool.recycle()
    pool.reset_peak()
    pool.take((1000,), np.float32)  # reused: no new bytes
    assert pool.peak_bytes == 4096 + 256
    pool.take((1000,), np.float32)  # a second 4 KiB take in the step: new
    assert pool.peak_bytes == 2 * 4096 + 256
    pool.recycle()
    pool.release()
    assert pool.allocated_bytes == 0 and pool.peak_bytes == 2 * 4096 + 256


def test_a_layer_gives_back_all_but_what_the_next_layer_reads():
    pool = StepPool(lambda shape, dtype: np.empty(shape, dtype))
    before = pool.take((64,), np.float32)  # an input: taken before the mark, lives all step
    mark = pool.mark()
    x = pool.take((1000,), np.float32)
    temporary = pool.take((1000,), np.float32)
    residual = pool.take((1000,), np.float32).reshape(10, 100)  # a reshape still names its buffer
    pool.recycle_since(mark, keep=(x, residual))
    again = pool.take((1000,), np.float32)  # the next layer's first take: the temporary's buffer
    assert np.shares_memory(again, temporary)
    fresh = pool.take((1000,), np.float32)
    assert not any(np.shares_memory(fresh, a) for a in (x, residual, before, again))
    assert pool.allocated_bytes == 256 + 4 * 4096  # x, temporary, residual, and one new
