"""MOEBUS_CUDA_STACK_BYTES: read at a cuda backend's start, a clear error for a bad value; on a GPU the
context's stack limit follows it and a kernel that needs more local memory still runs (the driver
raises the limit at its launch)."""
import numpy as np
import pytest

from moebus.common.errors import ConfigError
from moebus.cuda.kernels.compat import SIMULATOR, cuda
from moebus.cuda.memory.context_limits import (VISION_STACK_BYTES, context_mib, lower_stack_limit,
                                               stack_bytes_from_env, stack_limit_bytes, vision_context_mib,
                                               vision_stack_bytes)


def test_the_stack_limit_is_the_drivers_unless_asked():
    assert stack_bytes_from_env({}) is None and stack_bytes_from_env({"MOEBUS_CUDA_STACK_BYTES": ""}) is None
    assert lower_stack_limit({}) is None  # nothing asked: the driver is not called
    assert stack_bytes_from_env({"MOEBUS_CUDA_STACK_BYTES": "256"}) == 256


def test_a_llava_vision_worker_lowers_it_unless_told_otherwise():
    """Unset, a LLaVA vision worker's context takes 64 B a thread (measured on the H200: 248 MiB less
    footprint, the limit still 64 B after its encodes); Qwen3-VL's and the text workers' the driver's."""
    assert vision_stack_bytes("siglip") == 64 == VISION_STACK_BYTES
    assert vision_stack_bytes("clip") == 64
    assert vision_stack_bytes("qwen3_vl") is None
    assert stack_bytes_from_env({}, default=64) == 64
    assert stack_bytes_from_env({"MOEBUS_CUDA_STACK_BYTES": "1024"}, default=64) == 1024  # the setting wins


def test_a_context_not_yet_measured_is_reckoned_by_its_stack_limit():
    """The broker's first reserve for a vision worker: 512 MiB with the driver's limit (the seed's ~0.5 GiB,
    the H200's 526); at 64 B the H200 measured 277.6 MiB, reckoned for up to 160 SMs as 284."""
    assert context_mib(None) == 512 == context_mib(1024) == context_mib(1 << 20)
    assert context_mib(64) == 284 and 277.6 <= context_mib(64) < 300
    assert context_mib(1) == 265 and context_mib(256) == 264 + 80
    assert vision_context_mib("siglip", {}) == 284 and vision_context_mib("clip", {"MOEBUS_CUDA_STACK_BYTES": "512"}) == 424
    assert vision_context_mib("qwen3_vl", {}) == 512 and vision_context_mib("qwen3_vl", {"MOEBUS_CUDA_STACK_BYTES": "64"}) == 284
    assert vision_context_mib("siglip", {"MOEBUS_CUDA_STACK_BYTES": "x"}) == 512  # (the worker refuses it at its start)


@pytest.mark.parametrize("text", ["0", "-1", "1k", "2097152", "25.5", "²", "9" * 40, " 64"])
def test_a_bad_stack_limit_names_the_setting(text):
    with pytest.raises(ConfigError, match=f"MOEBUS_CUDA_STACK_BYTES must be a byte count .* got '{text}'"):
        stack_bytes_from_env({"MOEBUS_CUDA_STACK_BYTES": text})


@pytest.mark.skipif(SIMULATOR, reason="the driver's limit: a GPU only")
def test_a_kernel_needing_more_stack_than_the_limit_still_runs():
    cuda.current_context()
    before, now = lower_stack_limit({"MOEBUS_CUDA_STACK_BYTES": "64"})
    assert now <= 256 < before  # lowered (the driver may round up)

    @cuda.jit
    def reverse_through_local(x, out):
        scratch = cuda.local.array(200, np.float32)  # 800 B a thread, more than the limit
        i = cuda.grid(1)
        if i < x.shape[0]:
            for j in range(200):
                scratch[j] = x[i, j]
            for j in range(200):
                out[i, j] = scratch[199 - j]

    x = np.arange(64 * 200, dtype=np.float32).reshape(64, 200)
    out = cuda.device_array_like(x)
    try:
        assert stack_limit_bytes() == now  # what the vision worker's first encodes log
        reverse_through_local[1, 64](cuda.to_device(x), out)
        np.testing.assert_array_equal(out.copy_to_host(), x[:, ::-1])
        print(f"stack limit {now} B before the launch, {stack_limit_bytes()} B after it")  # raised, or spilled
    finally:  # the next tests in this process run at the driver's limit again
        lower_stack_limit({"MOEBUS_CUDA_STACK_BYTES": str(before)})
