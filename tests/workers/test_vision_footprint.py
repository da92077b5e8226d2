"""The vision worker's start footprint (workers/vision_footprint.py) where no GPU is: NVML's spelling
of a UUID, and a start that cannot read NVML goes on with the footprint unknown (None), so the
broker keeps its default reserve. On a GPU: tests/cuda/test_vision_footprint.py."""
import pytest

from moebus.workers.vision_footprint import Nvml, StartFootprint, uuid_text


def test_a_uuid_is_spelled_as_nvml_spells_it():
    raw = bytes(range(16))
    assert uuid_text(raw) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


def test_cpu_measures_nothing():
    footprint = StartFootprint("cpu")
    footprint.context_made(None)
    assert footprint.done(None, keep=True) is None and footprint.describe(1 << 20) == "not measured"
    assert footprint.after_first_encode() is None and footprint.encode_bytes is None


def test_without_nvml_the_footprint_is_unknown_and_the_start_goes_on():
    """No GPU with this UUID: pynvml raises (NVML not found here, no such device on a GPU machine;
    ImportError without the cuda extra), and the start goes on without a figure."""
    def no_such_gpu():
        return Nvml("GPU-00000000-0000-0000-0000-000000000000")

    try:
        import pynvml
        errors = (pynvml.NVMLError,)
    except ImportError:
        errors = (ImportError,)
    with pytest.raises(errors):
        no_such_gpu()
    footprint = StartFootprint("cuda", make_nvml=no_such_gpu)
    assert footprint.nvml is None
    footprint.context_made(1 << 30)
    assert footprint.done(1 << 29, keep=True) is None and footprint.total_bytes is None
    assert footprint.after_first_encode() is None
