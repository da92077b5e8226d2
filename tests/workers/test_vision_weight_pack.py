"""The vision tower's weights packed in one host buffer (the zygote's) and uploaded in one copy
(workers/vision_weight_pack.py): the same tensors come out, aligned; on the cuda backend (numba's
simulator here) each weight is a view of the one device buffer, whichever way it was copied, and a
tensor a model derives (not a view of the buffer) is uploaded on its own."""
import numpy as np
import pytest

from moebus.common.qwen3vl_config import parse_qwen3_vision_config
from moebus.common.qwen3vl_tiny import qwen3vl_config, vision_tensors
from moebus.common.tiny_model import _Random, hf_config
from moebus.cuda.dtypes import f32_to_bf16
from moebus.workers import vision_weight_pack
from moebus.workers.vision_model import make_vision_model
from moebus.workers.vision_weight_pack import (ALIGN_BYTES, PAGE_BYTES, DeviceWeights, HostWeights, pack,
                                                 upload_bytes)


def _weights():
    rng = np.random.default_rng(5)
    return {"a": rng.standard_normal((3, 5), dtype=np.float32),
            "b": f32_to_bf16(rng.standard_normal(7, dtype=np.float32)),
            "c": np.arange(12, dtype=np.int32).reshape(2, 2, 3)[:, :, ::2]}  # not contiguous: packed contiguous


def test_packed_tensors_equal_the_originals_and_start_aligned():
    weights = _weights()
    packed = pack(weights)
    assert isinstance(packed, HostWeights) and list(packed) == list(weights)
    base = packed.buffer.__array_interface__["data"][0]
    for name, array in weights.items():
        view = packed[name]
        np.testing.assert_array_equal(view, array)
        assert view.dtype == array.dtype and view.flags.c_contiguous and np.shares_memory(view, packed.buffer)
        assert (view.__array_interface__["data"][0] - base) % ALIGN_BYTES == 0
    assert packed.buffer.nbytes == PAGE_BYTES and base % PAGE_BYTES == 0  # 3 x 256 bytes of tensors, one page


@pytest.mark.parametrize("mode", ["pinned", "pageable", "register"])  # register: pinned chunks in the simulator
def test_one_upload_gives_views_of_every_packed_tensor(mode, monkeypatch):
    from moebus.cuda.backends.cuda import CudaBackend

    monkeypatch.setattr(vision_weight_pack, "UPLOAD_MODE", mode)
    monkeypatch.setattr(vision_weight_pack, "CHUNK_BYTES", 1000)  # a page in 5 chunks through 2 buffers
    packed = pack(_weights())
    device = DeviceWeights(CudaBackend(), packed)
    assert device.nbytes == packed.buffer.nbytes
    np.testing.assert_array_equal(device.device.copy_to_host(), packed.buffer)
    for name, array in packed.items():
        np.testing.assert_array_equal(device.view(array).copy_to_host(), array)
    assert device.view(packed["a"][1:]) is not None  # a contiguous part of one (Qwen3-VL's q, k, v biases)
    assert device.view(packed["a"].copy()) is None and device.view(packed["a"][:, 1:]) is None


def test_an_upload_beside_the_caller_is_whole_after_its_wait(monkeypatch):
    from moebus.cuda.backends.cuda import CudaBackend

    monkeypatch.setattr(vision_weight_pack, "CHUNK_BYTES", 1000)
    packed = pack(_weights())
    device = DeviceWeights(CudaBackend(), packed, beside=True)
    assert device.wait() >= 0 and device.wait() == 0.0  # joined once
    np.testing.assert_array_equal(device.device.copy_to_host(), packed.buffer)
    for name, array in packed.items():
        np.testing.assert_array_equal(device.view(array).copy_to_host(), array)


def test_a_failed_upload_beside_is_done_again_at_its_wait(monkeypatch, caplog):
    from moebus.cuda.backends.cuda import CudaBackend

    real, calls = vision_weight_pack.upload_into, []

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("no copy")
        return real(*args, **kwargs)

    monkeypatch.setattr(vision_weight_pack, "upload_into", fail_once)
    packed = pack(_weights())
    device = DeviceWeights(CudaBackend(), packed, beside=True)
    device.wait()
    assert len(calls) == 2 and "copied again now" in caplog.text
    np.testing.assert_array_equal(device.device.copy_to_host(), packed.buffer)


def test_upload_in_chunks_equals_the_host_bytes():
    from moebus.cuda.backends.cuda import CudaBackend

    host = np.random.default_rng(1).integers(0, 256, 1000, dtype=np.uint8)
    for chunk in (64, 999, 1000, 4096):
        np.testing.assert_array_equal(upload_bytes(CudaBackend(), host, chunk, "pinned").copy_to_host(), host)


def test_a_qwen3vl_tower_on_packed_weights_holds_the_same_tensors():
    from moebus.cuda.backends.cuda import CudaBackend

    raw = qwen3vl_config(hf_config("qwen3_moe", "tiny"), "tiny", {})
    cfg = parse_qwen3_vision_config(raw)
    weights = {k[len("model.visual."):]: f32_to_bf16(v) for k, v in vision_tensors(raw, _Random(3, False)).items()}
    plain, packed = (make_vision_model(cfg, w, CudaBackend()) for w in (weights, pack(weights)))
    assert packed.packed is not None and plain.packed is None
    assert packed.device_bytes == packed.packed.nbytes  # every tensor a view: one allocation
    assert plain.device_bytes <= packed.device_bytes < plain.device_bytes + ALIGN_BYTES * len(weights)
    for block_plain, block_packed in zip(plain.blocks, packed.blocks):
        assert block_plain.keys() == block_packed.keys()
        for name in block_plain:
            np.testing.assert_array_equal(block_packed[name].copy_to_host(), block_plain[name].copy_to_host())
    np.testing.assert_array_equal(packed.pos_table.copy_to_host(), plain.pos_table.copy_to_host())
