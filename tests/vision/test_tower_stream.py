"""LLaVA's encoder layers streamed through two device slots (workers/tower_stream.py,
MOEBUS_VISION_STREAM_LAYERS=1): the encode gives the resident tower's bits, encode after encode, with
two layers' weights on the device. On the simulator here (copies complete as they are enqueued); on a
GPU (MOEBUS_TEST_GPU=1) the side stream's copies, the events between the streams and the graph's replay."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from moebus.common.errors import ConfigError  # noqa: E402
from moebus.common.image_processor import ImageProcessor  # noqa: E402
from moebus.common.vision_config import load_vision_config  # noqa: E402
from moebus.cuda.backends import make_backend  # noqa: E402
from moebus.workers import tower_slices  # noqa: E402
from moebus.workers.tower_stream import stream_layers_from_env  # noqa: E402
from moebus.workers.vision_model import VisionModel, load_vision_weights, make_vision_model  # noqa: E402
from moebus.workers.vision_weight_pack import pack  # noqa: E402
from tests.vision_models import make_hf_llava, sample_images  # noqa: E402


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    d = make_hf_llava(tmp_path_factory.mktemp("stream") / "model", tower="siglip", feature_layer=[1, -1],
                      dtype="bf16")
    proc = ImageProcessor.from_dir(d)
    px = np.stack([proc.preprocess(image) for image in sample_images()])
    return load_vision_config(d), load_vision_weights(d), px


def test_a_streamed_encode_gives_the_resident_towers_bits(llava, monkeypatch):
    cfg, weights, px = llava
    assert cfg.num_layers_run >= 3  # layer 2 reuses layer 0's slot
    monkeypatch.setenv("MOEBUS_VISION_STREAM_LAYERS", "0")
    resident = VisionModel(cfg, weights, make_backend("cuda"))
    want = [resident.encode(px[i : i + 1]) for i in range(len(px))]
    monkeypatch.setenv("MOEBUS_VISION_STREAM_LAYERS", "1")
    streamed = VisionModel(cfg, weights, make_backend("cuda"))
    assert streamed.layer_stream is not None and resident.layer_stream is None
    for _ in range(2):  # again: the slots hold the last layers of the encode before (on a GPU: the graph's replay)
        for i in range(len(px)):
            np.testing.assert_array_equal(streamed.encode(px[i : i + 1]), want[i])


def test_the_device_holds_two_layers(llava, monkeypatch):
    cfg, weights, _ = llava
    monkeypatch.setenv("MOEBUS_VISION_STREAM_LAYERS", "0")
    resident = VisionModel(cfg, weights, make_backend("cuda"))
    monkeypatch.delenv("MOEBUS_VISION_STREAM_LAYERS")  # LLaVA's default
    streamed = VisionModel(cfg, weights, make_backend("cuda"))
    layer_bytes = sum(int(a.nbytes) for a in VisionModel._host_layer(weights, 0).values())
    assert layer_bytes <= streamed.layer_stream.block_bytes < layer_bytes + 256 * (len(VisionModel._host_layer(weights, 0)) + 1)
    assert streamed.layer_stream.device_bytes == 2 * streamed.layer_stream.block_bytes
    assert streamed.layer_stream.host.size == cfg.num_layers_run * streamed.layer_stream.block_bytes
    # what the worker reports as its weights on the device: every layer fewer two
    assert resident.device_bytes - streamed.device_bytes >= (cfg.num_layers_run - 2) * layer_bytes - 2 * 256 * 16


def test_the_zygotes_packed_weights_are_not_uploaded_whole(llava, monkeypatch):
    cfg, weights, px = llava
    monkeypatch.setenv("MOEBUS_VISION_STREAM_LAYERS", "1")
    model = make_vision_model(cfg, pack(weights), make_backend("cuda"))
    assert model.packed is None and model.layer_stream is not None
    monkeypatch.setenv("MOEBUS_VISION_STREAM_LAYERS", "0")
    want = VisionModel(cfg, weights, make_backend("cuda")).encode(px[:1])
    np.testing.assert_array_equal(model.encode(px[:1]), want)


def test_the_packing_order_puts_each_layer_in_one_block_in_numeric_order():
    from moebus.workers.tower_stream import packing_order

    names = ["encoder.layers.10.b", "post_layernorm.weight", "encoder.layers.2.a", "encoder.layers.2.b",
             "encoder.layers.10.a", "embeddings.patch_embedding.weight", "blocks.1.x", "blocks.0.x"]
    assert packing_order(names) == ["post_layernorm.weight", "embeddings.patch_embedding.weight", "blocks.0.x",
                                    "blocks.1.x", "encoder.layers.2.a", "encoder.layers.2.b", "encoder.layers.10.a",
                                    "encoder.layers.10.b"]


def test_registered_the_layers_are_read_from_the_zygotes_packed_buffer(llava, monkeypatch):
    """MOEBUS_VISION_STREAM_HOST=register: the packed weights (the zygote's buffer, layer after layer) are
    the stream's host blocks, no pinned copy of them (on a GPU registered with the driver read-only); the
    encode still gives the resident tower's bits. Weights that are not one buffer are copied as before."""
    cfg, weights, px = llava
    monkeypatch.setenv("MOEBUS_VISION_STREAM_LAYERS", "0")
    want = VisionModel(cfg, weights, make_backend("cuda")).encode(px[:1])
    monkeypatch.setenv("MOEBUS_VISION_STREAM_LAYERS", "1")
    monkeypatch.setenv("MOEBUS_VISION_STREAM_HOST", "register")
    packed = pack(weights)
    model = make_vision_model(cfg, packed, make_backend("cuda"))
    stream = model.layer_stream
    from moebus.cuda.kernels.compat import SIMULATOR

    assert stream.host_source == ("packed" if SIMULATOR else "registered")  # (the simulator: no driver to ask)
    assert np.shares_memory(stream.host, packed.buffer)
    assert stream.host.size == cfg.num_layers_run * stream.block_bytes
    for _ in range(2):
        np.testing.assert_array_equal(model.encode(px[:1]), want)
    assert VisionModel(cfg, weights, make_backend("cuda")).layer_stream.host_source == "copy"  # not one buffer
    monkeypatch.setenv("MOEBUS_VISION_STREAM_HOST", "copy")  # the default
    assert make_vision_model(cfg, packed, make_backend("cuda")).layer_stream.host_source == "copy"
    monkeypatch.setenv("MOEBUS_VISION_STREAM_HOST", "pin")
    with pytest.raises(ConfigError, match="MOEBUS_VISION_STREAM_HOST must be one of copy, register"):
        make_vision_model(cfg, packed, make_backend("cuda"))


def test_the_cpu_backend_ignores_it_and_bad_values_are_named(llava, monkeypatch):
    cfg, weights, _ = llava
    monkeypatch.setenv("MOEBUS_VISION_STREAM_LAYERS", "1")
    assert VisionModel(cfg, weights, make_backend("cpu")).layer_stream is None  # host memory already
    assert stream_layers_from_env({}) is True and stream_layers_from_env({}, "clip") is True  # LLaVA's: measured
    assert stream_layers_from_env({}, "qwen3_vl") is False  # exact on a GPU, not yet timed: opt-in
    assert stream_layers_from_env({"MOEBUS_VISION_STREAM_LAYERS": "1"}, "qwen3_vl") is True
    assert stream_layers_from_env({"MOEBUS_VISION_STREAM_LAYERS": "0"}) is False
    for text in ("yes", "2", ""):
        with pytest.raises(ConfigError, match="MOEBUS_VISION_STREAM_LAYERS must be 0 or 1"):
            stream_layers_from_env({"MOEBUS_VISION_STREAM_LAYERS": text})
    monkeypatch.setattr(tower_slices, "SLICE_LAYERS", 1)
    with pytest.raises(ConfigError, match="does not go with MOEBUS_TOWER_SLICE_LAYERS"):
        VisionModel(cfg, weights, make_backend("cuda"))
    monkeypatch.delenv("MOEBUS_VISION_STREAM_LAYERS")  # unset, a tower in slices is not streamed: no error
    assert stream_layers_from_env({}) is False
    assert VisionModel(cfg, weights, make_backend("cuda")).layer_stream is None


def qwen3vl_tower():
    from moebus.common.qwen3vl_config import parse_qwen3_vision_config
    from moebus.common.qwen3vl_tiny import qwen3vl_config, vision_tensors
    from moebus.common.tiny_model import _Random, hf_config
    from moebus.cuda.dtypes import f32_to_bf16

    raw = qwen3vl_config(hf_config("qwen3_moe", "tiny"), "tiny", {})
    raw["vision_config"]["depth"] = 6  # more blocks than slots, DeepStack after blocks of every slot
    raw["vision_config"]["deepstack_visual_indexes"] = [1, 3]
    cfg = parse_qwen3_vision_config(raw)
    weights = {k[len("model.visual."):]: f32_to_bf16(v) for k, v in vision_tensors(raw, _Random(3, False)).items()}
    return cfg, weights


def test_qwen3vls_blocks_stream_through_three_slots_with_the_resident_towers_bits(monkeypatch):
    """A block's first norm adds the last block's fc2 bias: a slot is released a block late, and three
    slots keep one copy ahead. The simulator runs each copy and kernel as it is enqueued, so a slot
    overwritten while a later kernel still needed it would show in the bits."""
    from moebus.workers.qwen3vl_vision import STREAM_SLOTS, Qwen3VisionModel
    from moebus.workers.qwen3vl_weights import weight_bytes

    cfg, weights = qwen3vl_tower()
    assert cfg.depth > STREAM_SLOTS and set(cfg.deepstack_layers)
    grid_h, grid_w = 4, 6
    patches = [np.random.default_rng(seed).standard_normal((grid_h * grid_w, cfg.patch_dim)).astype(np.float32)
               for seed in (1, 2)]
    resident = Qwen3VisionModel(cfg, weights, make_backend("cuda"))
    want = [resident.encode(p, grid_h, grid_w) for p in patches]
    monkeypatch.setenv("MOEBUS_VISION_STREAM_LAYERS", "1")
    streamed = Qwen3VisionModel(cfg, weights, make_backend("cuda"))
    assert streamed.layer_stream.slots == STREAM_SLOTS and resident.layer_stream is None
    for _ in range(2):
        for p, (embeds, deepstack) in zip(patches, want):
            got_embeds, got_deepstack = streamed.encode(p, grid_h, grid_w)
            np.testing.assert_array_equal(got_embeds, embeds)
            np.testing.assert_array_equal(got_deepstack, deepstack)
    # the broker's reserve for the tower counts three blocks (plus their alignment), not all of them
    on_device = weight_bytes(cfg, 2, STREAM_SLOTS)
    assert weight_bytes(cfg, 2) - on_device >= (cfg.depth - STREAM_SLOTS) * 2 * 4 * cfg.hidden_size ** 2
    assert streamed.device_bytes <= on_device <= resident.device_bytes


def test_the_brokers_reserve_for_a_streamed_qwen3vl_tower_counts_three_blocks(monkeypatch):
    """Qwen3-VL-30B-A3B's tower (27 blocks of ~30 MiB): the reserve the broker hands back for it falls by
    the 24 blocks left in host memory."""
    from moebus.broker.vision_qwen3vl import cuda_vision_mib
    from moebus.common.qwen3vl_config import parse_qwen3_vision_config
    from moebus.common.qwen3vl_tiny import qwen3vl_config
    from moebus.common.tiny_model import hf_config
    from moebus.workers.qwen3vl_weights import BLOCK, expected_shapes, weight_bytes

    text = hf_config("qwen3_moe", "tiny")
    text["num_hidden_layers"] = max(text["num_hidden_layers"], 3)
    cfg = parse_qwen3_vision_config(qwen3vl_config(text, "a3b", {}))
    block = 2 * sum(int(np.prod(s)) for n, s in expected_shapes(cfg).items() if n.startswith(BLOCK.format(i=0)))
    assert cfg.depth == 27 and 29 << 20 < block < 32 << 20
    assert weight_bytes(cfg, 2) - weight_bytes(cfg, 2, 3) == 24 * block - 3 * 4096
    monkeypatch.delenv("MOEBUS_VISION_STREAM_LAYERS", raising=False)
    resident = cuda_vision_mib(cfg, None)
    monkeypatch.setenv("MOEBUS_VISION_STREAM_LAYERS", "1")
    assert abs((resident - cuda_vision_mib(cfg, None)) - (24 * block - 3 * 4096) / (1 << 20)) <= 1
    monkeypatch.setenv("MOEBUS_VISION_STREAM_LAYERS", "yes")  # the worker refuses it; the broker sizes as resident
    assert cuda_vision_mib(cfg, None) == resident


def test_the_zygotes_reckoning_of_the_device_bytes_is_what_the_model_holds(llava, monkeypatch):
    """The broker's first reserve for LLaVA on cuda (broker/vision_placement.py) comes from
    vision_worker.cuda_device_bytes: the weights the model uploads, streamed or not, plus the first encode's
    scratch and loads."""
    from moebus.workers.vision_worker import IMAGES_PER_PASS, cuda_device_bytes
    from moebus.workers.vision_model import first_encode_bytes

    cfg, weights, _ = llava
    scratch = first_encode_bytes(cfg, IMAGES_PER_PASS)
    monkeypatch.setenv("MOEBUS_VISION_STREAM_LAYERS", "0")
    resident = VisionModel(cfg, weights, make_backend("cuda"))
    assert cuda_device_bytes(cfg, weights, streamed=False) - scratch == resident.device_bytes
    streamed_bytes = cuda_device_bytes(cfg, weights, streamed=True) - scratch
    monkeypatch.delenv("MOEBUS_VISION_STREAM_LAYERS")
    streamed = VisionModel(cfg, weights, make_backend("cuda"))
    assert cuda_device_bytes(cfg, weights) - scratch == streamed_bytes  # (None: the setting, on for LLaVA)
    # the slots' tensors 256-aligned: at most 4 KiB a slot reckoned above what the stream takes
    assert 0 <= streamed_bytes - streamed.device_bytes <= 2 * 4096
