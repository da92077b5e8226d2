"""The vision worker's start footprint (workers/vision_footprint.py) on a GPU: NVML finds this
process's device by the UUID that CUDA reports, and the used bytes it counts grow by what the
process allocates between the two readings (256 MiB here), within the driver's rounding."""
import pytest

from moebus.cuda.backends.graphs import graphs_available
from moebus.workers.vision_footprint import StartFootprint

pytestmark = pytest.mark.skipif(not graphs_available(), reason="NVML's figures need a GPU")
MIB = 1 << 20


def test_the_footprint_counts_what_was_allocated_between_the_readings():
    from numba import cuda

    from moebus.cuda.memory.vmm import device_memory_info

    cuda.current_context().deallocations.clear()
    footprint = StartFootprint("cuda")
    assert footprint.nvml is not None, "NVML could not be read on this GPU"
    footprint.context_made(device_memory_info()[0])
    held = cuda.device_array(256 * MIB, dtype="uint8")
    total = footprint.done(device_memory_info()[0])
    assert 256 * MIB <= total <= 256 * MIB + 64 * MIB, total / MIB
    assert footprint.context_bytes is not None and footprint.context_bytes <= 64 * MIB  # no new context here
    assert footprint.nvml is None and footprint.after_first_encode() is None  # closed: a warmed-up start's
    del held


def test_a_start_without_warm_up_reads_again_after_its_first_encode():
    """What a lazy vision worker's first encode reply says: the start's footprint and what came since."""
    from numba import cuda

    cuda.current_context().deallocations.clear()
    footprint = StartFootprint("cuda")
    held = cuda.device_array(64 * MIB, dtype="uint8")
    start = footprint.done(None, keep=True)
    assert footprint.nvml is not None and 64 * MIB <= start <= 128 * MIB, start / MIB
    scratch = cuda.device_array(128 * MIB, dtype="uint8")  # the first encode's scratch
    total = footprint.after_first_encode()
    assert 128 * MIB <= footprint.encode_bytes <= 160 * MIB and total == start + footprint.encode_bytes
    footprint.close()
    assert footprint.nvml is None
    del held, scratch
