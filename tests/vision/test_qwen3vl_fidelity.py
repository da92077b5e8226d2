"""Qwen3-VL-MoE against transformers' Qwen3VLMoeForConditionalGeneration on checkpoints it wrote
(fp32, cpu): a text-only chat, a chat with one image and one with two images of different sizes.
Our chat template, <|image_pad|> expansion, image processor, M-RoPE positions, tower and DeepStack
against the reference's; greedy tokens equal, logprobs within 1e-3. The Hub layout (fused experts
transposed, the Hub's config and preprocessor keys) and one tensor per expert give the same numbers."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from moebus.common.tokenizer import TextTokenizer  # noqa: E402
from moebus.workers.qwen3vl_local import Qwen3VLLocal  # noqa: E402
from tests.vision.qwen3vl_models import hub_layout, make_hf_qwen3vl, per_expert_layout, sample_images  # noqa: E402

TEXT_ONLY = [{"role": "system", "content": "You answer briefly."},
             {"role": "user", "content": "What is the model cache?"}]
ONE_IMAGE = [{"role": "user", "content": [{"type": "text", "text": "Describe this:"}, {"type": "image"}]}]
TWO_IMAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is the first and"},
                                           {"type": "image"}, {"type": "text", "text": " the second image?"}]}]
CASES = [(TEXT_ONLY, 0), (ONE_IMAGE, 1), (TWO_IMAGES, 2)]
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3vl")
    hf_dir = make_hf_qwen3vl(root / "hf")
    hf = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # greedy past end-of-sequence, as tests/models.hf_greedy
    # the PIL image processor, which moebus mirrors (AutoImageProcessor picks the torchvision one where
    # torchvision is installed: its resize rounds some pixels to the next 1/255)
    processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(hf_dir)
    return {"dir": hf_dir, "hf": hf, "processor": processor,
            "tokenizer": transformers.AutoTokenizer.from_pretrained(hf_dir),
            "save_pretrained": Qwen3VLLocal(hf_dir, num_slots=2, max_context=256),
            "hub": Qwen3VLLocal(hub_layout(hf_dir, root / "hub"), num_slots=2, max_context=256),
            "per_expert": Qwen3VLLocal(per_expert_layout(hf_dir, root / "per_expert"), num_slots=2, max_context=256)}


def hf_inputs(models, messages, images) -> dict:
    """What Qwen3VLProcessor makes: the template rendered, each <|image_pad|> repeated grid / merge^2
    times (replace_image_token), tokenized; pixel values, grids and the token types."""
    tok, hf = models["tokenizer"], models["hf"]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    kwargs = {}
    if images:
        pix = models["processor"](images=images, return_tensors="pt")
        parts = text.split("<|image_pad|>")
        counts = [int(g.prod()) // 4 for g in pix["image_grid_thw"]]
        text = parts[0] + "".join("<|image_pad|>" * n + rest for n, rest in zip(counts, parts[1:]))
        kwargs = dict(pixel_values=pix["pixel_values"], image_grid_thw=pix["image_grid_thw"])
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    kwargs["mm_token_type_ids"] = (ids == hf.config.image_token_id).int()
    return {"text": text, "input_ids": ids, **kwargs}


def hf_greedy(models, inputs) -> tuple[list[int], list[float]]:
    ids = inputs["input_ids"]
    with torch.no_grad():
        out = models["hf"].generate(**{k: v for k, v in inputs.items() if k != "text"}, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_TOKENS, do_sample=False,
                                    output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    logprobs = [float(torch.log_softmax(step[0], -1)[t]) for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


@pytest.mark.parametrize("messages, num_images", CASES, ids=["text", "one_image", "two_images"])
def test_prompt_pixels_and_logits_equal_transformers(models, messages, num_images):
    images = sample_images()[:num_images]
    ref = hf_inputs(models, messages, images)
    ours = models["save_pretrained"]
    assert TextTokenizer(models["dir"]).render_chat(messages) == models["tokenizer"].apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
    ids, patches = ours.prepare(TextTokenizer(models["dir"]).encode_chat(messages), images)
    assert ids == ref["input_ids"][0].tolist()
    if images:
        np.testing.assert_allclose(np.concatenate([p.patches for p in patches]), ref["pixel_values"].numpy(),
                                   rtol=0, atol=1e-5)
        assert [[1, p.grid_h, p.grid_w] for p in patches] == ref["image_grid_thw"].tolist()
    with torch.no_grad():
        expected = models["hf"](**{k: v for k, v in ref.items() if k != "text"}).logits[0, -1].numpy()
    hub_ids, hub_patches = models["hub"].prepare(TextTokenizer(models["dir"]).encode_chat(messages), images)
    assert hub_ids == ids and all(np.array_equal(a.patches, b.patches) for a, b in zip(hub_patches, patches))
    for layout in ("save_pretrained", "hub", "per_expert"):
        logits = models[layout].prefill_logits([ids], [patches])[0]
        assert np.abs(logits - expected).max() <= 1e-3, layout
    assert np.abs(expected).max() > 1.0


@pytest.mark.parametrize("messages, num_images", CASES, ids=["text", "one_image", "two_images"])
def test_greedy_tokens_and_logprobs_equal_transformers(models, messages, num_images):
    images = sample_images()[:num_images]
    ref_tokens, ref_logprobs = hf_greedy(models, hf_inputs(models, messages, images))
    ours = models["save_pretrained"]
    ids, patches = ours.prepare(TextTokenizer(models["dir"]).encode_chat(messages), images)
    out = ours.generate(ids, NUM_TOKENS, patches)
    assert out.tokens == ref_tokens
    np.testing.assert_allclose(out.logprobs, ref_logprobs, rtol=0, atol=1e-3)


def test_images_reach_the_language_model_and_batching_changes_nothing(models):
    from PIL import Image

    ours = models["save_pretrained"]
    ids = TextTokenizer(models["dir"]).encode_chat(ONE_IMAGE)
    images = sample_images()
    other = Image.fromarray(np.random.default_rng(5).integers(0, 256, (40, 70, 3), dtype=np.uint8))
    (a_ids, a), (b_ids, b), (c_ids, c) = (ours.prepare(ids, [image]) for image in (images[1], images[2], other))
    assert len(a_ids) != len(b_ids) and a_ids == c_ids  # 40 x 70 and 90 x 50 px: other grids, other counts
    first, second = ours.prefill_logits([a_ids, b_ids], [a, b])
    assert np.abs(second - ours.prefill_logits([b_ids], [b])[0]).max() < 1e-4
    assert np.abs(first - ours.prefill_logits([c_ids], [c])[0]).max() > 1e-2  # the pixels matter
