"""A new image size's first encode runs eagerly; its graph is captured once the reply has left
(workers/vision_worker.CaptureAfterReply, tower_graph.capture_pending), or (CAPTURE_WHEN "idle") once the
GPU is idle, or (``next``) by the next encode of that size. On a GPU (MOEBUS_TEST_GPU=1): the replayed
graph equals that eager encode bit for bit, on packed weights, with its pinned buffers made at the capture
or (PIN_AHEAD) with the eager encode."""
import numpy as np
import pytest

from moebus.common.protocol import EncodeReply
from moebus.common.qwen3vl_config import parse_qwen3_vision_config
from moebus.common.qwen3vl_tiny import qwen3vl_config, vision_tensors
from moebus.common.tiny_model import _Random, hf_config
from moebus.cuda.dtypes import f32_to_bf16
from moebus.cuda.kernels.compat import SIMULATOR
from moebus.workers import tower_graph
from moebus.workers.vision_worker import CaptureAfterReply


class Link:
    def __init__(self, events, inbox=()):
        self.events, self.inbox = events, list(inbox)

    def send(self, message):
        self.events.append(("sent", type(message).__name__))

    def recv(self, timeout_s=None):
        self.events.append(("recv",))
        return self.inbox.pop(0) if self.inbox else None


class Model:
    def __init__(self, events):
        self.events = events
        self.graph = self  # (TowerGraph's pending / capture_parts)
        self.capture_parts = "staging pinned 0.1 ms"
        self.waits = True

    def pending(self):
        return self.waits

    def capture_pending(self):
        self.events.append(("captured",))
        self.waits = False
        return 0.2


class Nvml:
    def __init__(self, percents):
        self.percents = list(percents)

    def busy_percent(self):  # (the last reading stays)
        return self.percents.pop(0) if len(self.percents) > 1 else self.percents[0]


def _reply(encode_id=1):
    return EncodeReply(encode_id=encode_id, generation="g1", embeds=np.zeros((1, 2), np.float32))


def test_the_capture_follows_the_reply_and_only_a_good_encode_reply():
    events = []
    link = CaptureAfterReply(Link(events), Model(events))
    link.send(EncodeReply(encode_id=1, generation="g1", embeds=np.zeros((1, 2), np.float32)))
    link.send(EncodeReply(encode_id=2, generation="g1", error="bad image", image=0))
    assert events == [("sent", "EncodeReply"), ("captured",), ("sent", "EncodeReply")]
    assert link.recv(timeout_s=0.1) is None


def test_an_idle_capture_waits_for_an_idle_gpu(monkeypatch):
    monkeypatch.setattr(tower_graph, "CAPTURE_BUSY_PERCENT", 10)
    events = []
    model = Model(events)
    model.waits = False  # (no boot warm-up: nothing waits before the first reply)
    link = CaptureAfterReply(Link(events), model, make_nvml=lambda: Nvml([80, 40, 3]), when="idle")
    assert not link.waiting
    model.waits = True
    link.POLL_S = 0.001
    link.send(_reply())
    assert events == [("sent", "EncodeReply")] and link.waiting  # not while the GPU is busy
    assert link.recv(timeout_s=5.0) is None
    assert events[1:] == [("recv",)] * 3 + [("captured",)] and not link.waiting
    assert link.recv(timeout_s=0.1) is None and events[-1] == ("recv",)  # nothing waits: a plain recv


def test_an_idle_capture_gives_way_to_a_message_and_stops_at_the_timeout(monkeypatch):
    monkeypatch.setattr(tower_graph, "CAPTURE_BUSY_PERCENT", 10)
    events, shutdown = [], object()
    link = CaptureAfterReply(Link(events, [None, shutdown]), Model(events), make_nvml=lambda: Nvml([90]),
                             when="idle")
    link.POLL_S = 0.001
    link.send(_reply())
    assert link.recv(timeout_s=5.0) is shutdown and ("captured",) not in events and link.waiting
    assert link.recv(timeout_s=0.01) is None and ("captured",) not in events  # busy throughout: not yet


def test_an_idle_capture_takes_a_boot_warm_ups_shape_too(monkeypatch):
    monkeypatch.setattr(tower_graph, "CAPTURE_BUSY_PERCENT", 10)
    events = []
    link = CaptureAfterReply(Link(events), Model(events), make_nvml=lambda: Nvml([2]), when="idle")
    assert link.waiting and link.recv(timeout_s=1.0) is None and events == [("recv",), ("captured",)]


def test_next_never_captures_after_a_reply_and_idle_without_nvml_does():
    events = []
    link = CaptureAfterReply(Link(events), Model(events), when="next")
    link.send(_reply())
    assert link.recv(timeout_s=0.01) is None and ("captured",) not in events

    def no_nvml():
        raise RuntimeError("no NVML here")

    events = []
    link = CaptureAfterReply(Link(events), Model(events), make_nvml=no_nvml, when="idle")
    link.send(_reply())
    assert link.when == "reply" and events == [("sent", "EncodeReply"), ("captured",)]


@pytest.fixture(params=[False, True], ids=["pinned_at_capture", "pinned_ahead"])
def pin_ahead(request, monkeypatch):
    monkeypatch.setattr(tower_graph, "PIN_AHEAD", request.param)
    return request.param


@pytest.mark.skipif(SIMULATOR, reason="CUDA graphs need a GPU (MOEBUS_TEST_GPU=1)")
def test_the_graph_captured_after_an_eager_encode_replays_it_bit_for_bit(pin_ahead):
    from moebus.cuda.backends.cuda import CudaBackend
    from moebus.workers.vision_model import make_vision_model
    from moebus.workers.vision_weight_pack import pack

    raw = qwen3vl_config(hf_config("qwen3_moe", "tiny"), "tiny", {})
    cfg = parse_qwen3_vision_config(raw)
    weights = {k[len("model.visual."):]: f32_to_bf16(v) for k, v in vision_tensors(raw, _Random(3, False)).items()}
    model = make_vision_model(cfg, pack(weights), CudaBackend())
    assert model.packed is not None and model.graph.enabled
    grid_h, grid_w = 18, 16  # over the tensor cores' threshold, as a real image
    patches = np.random.default_rng(2).standard_normal((grid_h * grid_w, cfg.patch_dim)).astype(np.float32)
    eager = model.encode(patches, grid_h, grid_w)
    assert model.graph.last_path == "new shape, eager" and model.graph.graph.graph is None
    staging = model.graph.graph.staging
    assert (staging is not None) == pin_ahead
    assert model.capture_pending() > 0 and "instantiated" in model.graph.capture_parts
    assert pin_ahead == (model.graph.graph.staging is staging)  # ahead: the capture pinned nothing more
    replayed = model.encode(patches, grid_h, grid_w)
    assert model.graph.last_path == "replay"
    for got, want in zip(replayed, eager):
        np.testing.assert_array_equal(got, want)
    other = np.random.default_rng(3).standard_normal(patches.shape).astype(np.float32)
    again = model.encode(other, grid_h, grid_w)  # new inputs through the replay
    model.graph.close()
    model.graph.enabled = False
    for got, want in zip(again, model.encode(other, grid_h, grid_w)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.skipif(SIMULATOR, reason="CUDA graphs need a GPU (MOEBUS_TEST_GPU=1)")
def test_an_image_from_its_bytes_equals_its_patches_captured_and_eager_bit_for_bit(pin_ahead):
    """The bytes patchified on the device (cuda/kernels/patchify.py) and the DeepStack features copied
    out beside the later blocks (tower_graph.emit) give the host patches' encode, eager and replayed."""
    from PIL import Image

    from moebus.common.qwen3vl_image_processor import Qwen3VLImageProcessor
    from moebus.common.qwen3vl_tiny import preprocessor_config
    from moebus.cuda.backends.cuda import CudaBackend
    from moebus.workers.qwen3vl_vision import Qwen3VisionModel

    raw = qwen3vl_config(hf_config("qwen3_moe", "tiny"), "tiny", {})
    cfg = parse_qwen3_vision_config(raw)
    weights = {k[len("model.visual."):]: f32_to_bf16(v) for k, v in vision_tensors(raw, _Random(3, False)).items()}
    model = Qwen3VisionModel(cfg, weights, CudaBackend())
    proc = Qwen3VLImageProcessor(preprocessor_config(raw, "tiny"))
    side = 18 * cfg.patch_size  # over the tensor cores' threshold, as a real image
    pixels = np.random.default_rng(4).integers(0, 256, (side, side + 2 * cfg.patch_size, 3), dtype=np.uint8)
    image = proc.preprocess(Image.fromarray(pixels))
    assert image.pixels is not None
    eager = model.encode_image(image)
    assert model.graph.last_path == "new shape, eager" and len(model.graph.graph.early) == len(cfg.deepstack_layers)
    assert model.capture_pending() > 0
    replayed = model.encode_image(image)
    assert model.graph.last_path == "replay"
    model.graph.close()
    model.graph.enabled = False
    from_patches = model.encode(image.patches, image.grid_h, image.grid_w)
    for got, again, want in zip(eager, replayed, from_patches):
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(again, want)
