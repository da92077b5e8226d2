"""Qwen3-VL-MoE's pieces on their own: config keys in either spelling, the init-model directory
(transformers loads it and agrees), the image processor's settings and limits, M-RoPE positions
against transformers' get_rope_index, the broker's per-step rope positions and DeepStack rows."""

import numpy as np
import pytest

from moebus.broker.vision_qwen3vl import attach_embeds, stacked_embeds, step_qwen3vl
from moebus.common.errors import CheckpointError, RequestError
from moebus.common.model_config import parse_config
from moebus.common.qwen3vl_config import parse_qwen3_vision_config
from moebus.common.qwen3vl_image_processor import Qwen3VLImageProcessor, smart_resize
from moebus.common.qwen3vl_positions import expand_image_pads, rope_index, step_rope_positions
from moebus.common.qwen3vl_tiny import qwen3vl_config
from moebus.common.tiny_model import hf_config, init_model
from moebus.common.vision_config import load_vision_config

TEXT_HUB = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                vocab_size=320, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                rope_theta=5e6, rope_scaling={"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True})


def _raw(text: dict, **vision) -> dict:
    return {"architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe", "text_config": text,
            "vision_config": {"depth": 3, "hidden_size": 32, "num_heads": 4, "out_hidden_size": 64,
                              "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 2], **vision}}

def _tiny_tower():
    """(raw config, vision config, float32 weights) of the tiny Qwen3-VL tower the unit tests encode with."""
    from moebus.common.qwen3vl_tiny import vision_tensors
    from moebus.common.tiny_model import _Random

    raw = qwen3vl_config(hf_config("qwen3_moe", "tiny"), "tiny", {})
    return raw, parse_qwen3_vision_config(raw), \
        {k[len("model.visual."):]: v for k, v in vision_tensors(raw, _Random(1, False)).items()}



def test_config_in_either_spelling():
    hub = parse_config(_raw(TEXT_HUB))
    text = dict(TEXT_HUB, num_local_experts=8, rope_parameters={"rope_theta": 5e6, **TEXT_HUB["rope_scaling"]})
    for key in ("num_experts", "rope_scaling", "rope_theta"):
        text.pop(key)
    saved = parse_config(_raw(text))
    assert hub == saved
    assert hub.wrapper == "qwen3_vl" and hub.mrope_section == (4, 2, 2) and hub.rope_theta == 5e6
    assert hub.num_experts == 8 and hub.norm_topk_prob  # Qwen3-VL-MoE's router always renormalizes


@pytest.mark.parametrize("text, vision, match", [
    (dict(TEXT_HUB, rope_scaling={"mrope_section": [4, 2, 3]}), {}, "mrope_section"),
    (dict(TEXT_HUB, rope_scaling={"rope_type": "yarn"}), {}, "rope type"),
    (TEXT_HUB, {"deepstack_visual_indexes": [3]}, "deepstack"),
    (TEXT_HUB, {"num_position_embeddings": 15}, "square"),
    (TEXT_HUB, {"out_hidden_size": 32}, "out_hidden_size"),
])
def test_bad_configs_are_named(text, vision, match):
    with pytest.raises(CheckpointError, match=match):
        raw = _raw(text, **vision)
        parse_config(raw)
        parse_qwen3_vision_config(raw)


def test_a3b_preset_has_qwen3_vl_30b_a3b_shapes():
    cfg = parse_qwen3_vision_config(qwen3vl_config(hf_config("qwen3_moe", "a3b"), "a3b", {}))
    assert (cfg.depth, cfg.hidden_size, cfg.num_heads, cfg.patch_size, cfg.merge_size, cfg.out_hidden_size,
            cfg.deepstack_layers) == (27, 1152, 16, 16, 2, 2048, (8, 16, 24))


def test_init_model_refuses_fewer_layers_than_deepstack_features(tmp_path):
    """The a3b tower adds DeepStack features after 3 LM layers: a 2-layer model fails at init-model,
    saying so, not later in the loader."""
    with pytest.raises(ValueError, match="--layers must be at least"):
        init_model(tmp_path / "m", "qwen3_vl_moe", "a3b", num_layers=2, num_experts=8)
    assert not (tmp_path / "m" / "config.json").exists()


def test_init_model_loads_in_transformers_and_agrees(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from moebus.common.tokenizer import TextTokenizer
    from moebus.workers.qwen3vl_local import Qwen3VLLocal
    from tests.vision.qwen3vl_models import sample_images

    d = init_model(tmp_path / "m", "qwen3_vl_moe", "tiny", dtype="f32")
    assert load_vision_config(d).tower == "qwen3_vl"
    hf = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    ours = Qwen3VLLocal(d, num_slots=1, max_context=256)
    content = [{"type": "image"}, {"type": "text", "text": "What?"}]
    ids, patches = ours.prepare(TextTokenizer(d).encode_chat([{"role": "user", "content": content}]), sample_images()[:1])
    inp = torch.tensor([ids])
    with torch.no_grad():
        ref = hf(input_ids=inp, pixel_values=torch.tensor(patches[0].patches), mm_token_type_ids=(
            inp == hf.config.image_token_id).int(), image_grid_thw=torch.tensor([[1, patches[0].grid_h,
                                                                                 patches[0].grid_w]])).logits[0, -1]
    assert np.abs(ours.prefill_logits([ids], [patches])[0] - ref.numpy()).max() <= 1e-3


def test_image_processor_settings_in_either_spelling_and_limits():
    base = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "merge_size": 2}
    new = Qwen3VLImageProcessor({**base, "size": {"shortest_edge": 4096, "longest_edge": 65536}})
    old = Qwen3VLImageProcessor({**base, "min_pixels": 4096, "max_pixels": 65536})
    assert (new.min_pixels, new.max_pixels) == (old.min_pixels, old.max_pixels) == (4096, 65536)
    assert new.grid(1024, 768) == (12, 18)  # 192 x 288 px: under max_pixels, multiples of 32 px
    assert smart_resize(768, 1024, 32, 4096, 16777216) == (768, 1024)
    assert new.num_tokens(1024, 768) == 54
    with pytest.raises(RequestError, match="aspect ratio"):
        new.grid(4000, 10)
    with pytest.raises(CheckpointError, match="not supported"):
        Qwen3VLImageProcessor({"image_processor_type": "SiglipImageProcessor"})


def test_rope_index_equals_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    image = 7
    grids = [(4, 6), (6, 2)]  # patches; merged 2 x 3 and 3 x 1
    ids = expand_image_pads([1, 2, image, 3, 4, 5, image, 8, 9], image, [6, 3])
    positions, delta = rope_index(ids, image, grids, 2)
    cfg = transformers.Qwen3VLMoeConfig(text_config={"num_hidden_layers": 1}, vision_config={"depth": 1},
                                        image_token_id=image)
    model = transformers.Qwen3VLMoeModel.__new__(transformers.Qwen3VLMoeModel)
    model.config = cfg
    inp = torch.tensor([ids])
    ref, ref_delta = transformers.Qwen3VLMoeModel.get_rope_index(
        model, inp, (inp == image).int(), image_grid_thw=torch.tensor([[1, h, w] for h, w in grids]))
    np.testing.assert_array_equal(positions, ref[:, 0].numpy().T)
    assert delta == int(ref_delta[0, 0]) < 0
    # generated tokens continue at index + delta on every axis
    assert step_rope_positions(positions, delta, len(ids) - 1, 3).tolist() == \
        [positions[-1].tolist()] + [[len(ids) + k + delta] * 3 for k in range(2)]


class _Seq:
    def __init__(self, positions, delta, rows, deepstack):
        self.rope_positions, self.rope_delta, self.embed_positions, self.deepstack = positions, delta, rows, deepstack


def test_step_fields_follow_the_chunk():
    ids = expand_image_pads([1, 7, 2, 3], 7, [4])
    positions, delta = rope_index(ids, 7, [(4, 4)], 2)
    rows = np.array([1, 2, 3, 4], np.int32)
    deepstack = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)
    seq = _Seq(positions, delta, rows, deepstack)
    text = _Seq(None, 0, np.zeros(0, np.int32), None)
    out = step_qwen3vl([text, seq], starts=[10, 2], lengths=[1, 3])  # a decode token, then a prefill chunk
    assert out["rope_positions"].tolist() == [[10, 10, 10]] + positions[2:5].tolist()
    assert out["deepstack_rows"].tolist() == [1, 2, 3]  # rows 2..4 of the prompt, after the other's 1 token
    np.testing.assert_array_equal(out["deepstack"], deepstack[:, 1:4])
    assert step_qwen3vl([text], [0], [4]) == {}


def test_encoded_rows_stack_for_groups_and_split_back():
    embeds, deepstack = np.ones((4, 3), np.float32), np.zeros((2, 4, 3), np.float32)
    stacked = stacked_embeds(embeds, deepstack, 4)
    assert stacked.shape == (3, 4, 3) and stacked_embeds(embeds, deepstack, 5) is None
    assert stacked_embeds(embeds, deepstack[:, :3], 4) is None
    seq = _Seq(None, 0, None, None)
    seq.embeds = None
    attach_embeds(seq, stacked)
    np.testing.assert_array_equal(seq.embeds, embeds)
    np.testing.assert_array_equal(seq.deepstack, deepstack)
    assert stacked_embeds(stacked, None, 4) is stacked  # sent stacked (the vision worker): taken as it is
    assert stacked_embeds(stacked, None, 5) is None and stacked_embeds(stacked[:0], None, 4) is None


def test_one_sequences_deepstack_rows_go_without_a_copy():
    ids = expand_image_pads([1, 7, 2], 7, [4])
    positions, delta = rope_index(ids, 7, [(4, 4)], 2)
    deepstack = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)
    seq = _Seq(positions, delta, np.array([1, 2, 3, 4], np.int32), deepstack)
    whole = step_qwen3vl([seq], [0], [6])["deepstack"]  # all its rows in one step: a view, not a copy
    assert np.shares_memory(whole, deepstack) and np.array_equal(whole, deepstack)
    part = step_qwen3vl([seq], [0], [3])["deepstack"]
    assert part.flags.c_contiguous and np.array_equal(part, deepstack[:, :2])


def test_the_worker_replies_its_outputs_stacked():
    from moebus.cuda.backends import make_backend
    from moebus.workers.qwen3vl_vision import Qwen3VisionModel

    _, cfg, weights = _tiny_tower()
    model = Qwen3VisionModel(cfg, weights, make_backend("cpu"))
    rng = np.random.default_rng(5)
    from types import SimpleNamespace

    images = [SimpleNamespace(patches=rng.standard_normal((h * w, cfg.patch_dim)).astype(np.float32), grid_h=h,
                              grid_w=w, pixels=None) for h, w in ((4, 6), (2, 4))]
    for some in (images[:1], images):
        embeds, deepstack = model.encode_images(some)
        reply = model.encode_reply(some)
        assert set(reply) == {"embeds"} and reply["embeds"].shape == (1 + deepstack.shape[0],) + embeds.shape
        np.testing.assert_array_equal(reply["embeds"], np.concatenate([embeds[None], deepstack]))


def test_a_grid_beyond_the_rotary_tables_grows_them():
    from moebus.cuda.backends import make_backend
    from moebus.cuda.kernels.mrope import vision_rope_tables
    from moebus.workers.qwen3vl_vision import Qwen3VisionModel

    _, cfg, weights = _tiny_tower()
    model = Qwen3VisionModel(cfg, weights, make_backend("cpu"))
    side = model.max_side + 2
    embeds, deepstack = model.encode(np.zeros((2 * side, cfg.patch_dim), np.float32), 2, side)
    assert model.max_side == side and embeds.shape == (side // 2, 64) and deepstack.shape == (2, side // 2, 64)
    np.testing.assert_array_equal(model.cos, vision_rope_tables(cfg.head_dim, cfg.rope_theta, side)[0])


def test_several_images_encode_one_after_another_and_concatenate():
    from types import SimpleNamespace

    from moebus.cuda.backends import make_backend
    from moebus.workers.qwen3vl_vision import Qwen3VisionModel

    _, cfg, weights = _tiny_tower()
    model = Qwen3VisionModel(cfg, weights, make_backend("cpu"))
    rng = np.random.default_rng(1)
    images = [SimpleNamespace(patches=rng.standard_normal((h * w, cfg.patch_dim)).astype(np.float32), grid_h=h,
                              grid_w=w) for h, w in ((4, 6), (2, 4))]
    alone = [model.encode(i.patches, i.grid_h, i.grid_w) for i in images]
    embeds, deepstack = model.encode_images(images[:1])
    np.testing.assert_array_equal(embeds, alone[0][0])
    np.testing.assert_array_equal(deepstack, alone[0][1])
    embeds, deepstack = model.encode_images(images)
    assert embeds.shape == (6 + 2, 64) and deepstack.shape == (2, 8, 64)
    np.testing.assert_array_equal(embeds, np.concatenate([alone[0][0], alone[1][0]]))
    np.testing.assert_array_equal(deepstack, np.concatenate([alone[0][1], alone[1][1]], axis=1))


def test_an_image_from_its_bytes_encodes_as_from_its_patches():
    from PIL import Image

    from moebus.common.qwen3vl_tiny import preprocessor_config
    from moebus.cuda.backends import make_backend
    from moebus.workers.qwen3vl_vision import Qwen3VisionModel

    raw, cfg, weights = _tiny_tower()
    model = Qwen3VisionModel(cfg, weights, make_backend("cpu"))
    proc = Qwen3VLImageProcessor(preprocessor_config(raw, "tiny"))
    image = proc.preprocess(Image.fromarray(np.random.default_rng(2).integers(0, 256, (40, 56, 3), np.uint8)))
    assert image.pixels is not None and image.pixels.dtype == np.uint8
    for got, want in zip(model.encode_image(image), model.encode(image.patches, image.grid_h, image.grid_w)):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="expected uint8"):
        model.encode_pixels(image.pixels.astype(np.float32), image.values, image.grid_h, image.grid_w)


def test_the_captured_encode_equals_the_eager_one_and_a_new_size_captures_anew():
    from moebus.cuda.kernels.compat import SIMULATOR
    from moebus.workers.qwen3vl_vision import Qwen3VisionModel

    if SIMULATOR:
        pytest.skip("CUDA graphs need a GPU (MOEBUS_TEST_GPU=1)")
    from moebus.cuda.backends import make_backend
    from moebus.cuda.backends.cuda import CudaBackend

    _, cfg, weights = _tiny_tower()
    cpu, cuda = Qwen3VisionModel(cfg, weights, make_backend("cpu")), Qwen3VisionModel(cfg, weights, CudaBackend())
    assert cuda.graph.enabled  # captured by default
    rng = np.random.default_rng(0)
    for grid_h, grid_w in ((4, 6), (6, 4), (4, 6)):
        patches = rng.standard_normal((grid_h * grid_w, cfg.patch_dim)).astype(np.float32)
        (embeds, deepstack), (want_embeds, want_deepstack) = cuda.encode(patches, grid_h, grid_w), \
            cpu.encode(patches, grid_h, grid_w)
        assert cuda.graph.key[:3] == (grid_h, grid_w, "")  # and the products' precision (the backend's)
        np.testing.assert_allclose(embeds, want_embeds, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(deepstack, want_deepstack, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(cuda.encode(patches, grid_h, grid_w)[0], embeds)  # replayed


def test_deepstack_rows_go_only_to_stages_holding_deepstack_layers():
    ids = expand_image_pads([1, 7, 2], 7, [4])
    positions, delta = rope_index(ids, 7, [(4, 4)], 2)
    seq = _Seq(positions, delta, np.array([1, 2, 3, 4], np.int32), np.ones((2, 4, 3), np.float32))
    assert "deepstack" in step_qwen3vl([seq], [0], [6], first_layer=1)
    later = step_qwen3vl([seq], [0], [6], first_layer=2)  # layers 2.. hold no DeepStack layer (L = 2)
    assert "deepstack" not in later and later["rope_positions"].shape == (6, 3)


def test_init_model_refuses_a_llava_tower_around_qwen3_vl(tmp_path):
    with pytest.raises(ValueError, match="its own vision tower"):
        init_model(tmp_path / "m", "qwen3_vl_moe", "tiny", vision="siglip")
