"""Image + text prompts: our prompt ids, pixel values, logits and greedy continuations against
transformers' LlavaProcessor and LlavaForConditionalGeneration on the same directory (fp32 compute)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from moebus.common.image_processor import ImageProcessor, expand_image_tokens  # noqa: E402
from moebus.common.tiny_model import init_model  # noqa: E402
from moebus.common.tokenizer import TextTokenizer  # noqa: E402
from moebus.workers.batch import StepBatch  # noqa: E402
from moebus.workers.local import LocalModel  # noqa: E402
from tests.vision_models import make_hf_llava, over_white, reference_composites_alpha, sample_images  # noqa: E402

MODELS = {
    "init_siglip_qwen3": lambda d: init_model(d, "qwen3_moe", "tiny", vision="siglip"),
    "init_clip_mixtral": lambda d: init_model(d, "mixtral", "tiny", vision="clip"),
    "hf_siglip_qwen3": lambda d: make_hf_llava(d, "siglip", "qwen3_moe", feature_layer=-1, strategy="full"),
    "hf_clip_mixtral": lambda d: make_hf_llava(d, "clip", "mixtral"),
    "hf_clip_qwen3_bf16": lambda d: make_hf_llava(d, "clip", "qwen3_moe", feature_layer=[0, -2], dtype="bf16"),
}
TWO_IMAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is the first and"},
                                           {"type": "image"}, {"type": "text", "text": " the second image?"}]}]
ONE_IMAGE = [{"role": "system", "content": "You answer briefly."},
             {"role": "user", "content": [{"type": "text", "text": "Describe this:"}, {"type": "image"}]}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            d = MODELS[name](tmp_path_factory.mktemp(name) / "model")
            hf = transformers.LlavaForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
            hf.generation_config.eos_token_id = None  # greedy past end-of-sequence, as tests/models.hf_greedy
            # the PIL backend, which moebus mirrors: where torchvision is installed transformers picks
            # its torchvision backend, whose resize rounds some pixels to the next 1/255
            processor = transformers.AutoProcessor.from_pretrained(d, backend="pil")
            cache[name] = (d, hf, processor, LocalModel(d, device="cpu", num_slots=4, max_context=256))
        return cache[name]

    return get


def ours_inputs(d, ours, messages, images):
    """Prompt ids and pixel values the way the service makes them: our chat template, then the
    placeholder expanded, our image processor."""
    tok = TextTokenizer(d)
    cfg = ours.vision_config
    ids = expand_image_tokens(tok.encode_chat(messages), cfg.image_token_id, cfg.num_image_tokens)
    proc = ImageProcessor.from_dir(d)
    return ids, np.stack([proc.preprocess(image) for image in images])


def hf_inputs(processor, messages, images):
    """transformers' prompt text, ids and pixel values. A transformers older than 5.21 drops an
    image's alpha instead of compositing it onto white (tests/vision_models.reference_composites_alpha):
    it is given the RGBA image over white, so that the models' fidelity is still compared."""
    if not reference_composites_alpha():
        images = [over_white(image) for image in images]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = processor(text=text, images=images, return_tensors="pt")
    return text, out["input_ids"], out["pixel_values"]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("messages, num_images", [(TWO_IMAGES, 2), (ONE_IMAGE, 1)])
def test_prompt_and_logits_equal_transformers(model, name, messages, num_images):
    d, hf, processor, ours = model(name)
    images = sample_images()[:num_images]
    text, hf_ids, hf_pixels = hf_inputs(processor, messages, images)
    assert TextTokenizer(d).render_chat(messages) == text
    ids, pixels = ours_inputs(d, ours, messages, images)
    assert ids == hf_ids[0].tolist()
    np.testing.assert_allclose(pixels, hf_pixels.numpy(), rtol=0, atol=1e-5)
    logits = ours.prefill_logits([ids], images=[pixels])[0]
    with torch.no_grad():
        ref = hf(input_ids=hf_ids, pixel_values=hf_pixels).logits[0, -1].numpy()
    assert np.abs(logits - ref).max() <= 1e-3
    assert np.abs(ref).max() > 1.0


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_continuation_identical(model, name):
    d, hf, processor, ours = model(name)
    images = sample_images()[:2]
    _, hf_ids, hf_pixels = hf_inputs(processor, TWO_IMAGES, images)
    ids, pixels = ours_inputs(d, ours, TWO_IMAGES, images)
    with torch.no_grad():
        ref = hf.generate(input_ids=hf_ids, pixel_values=hf_pixels, attention_mask=torch.ones_like(hf_ids),
                          max_new_tokens=12, do_sample=False)[0, hf_ids.shape[1]:].tolist()
    assert ours.generate(ids, 12, images=pixels).tokens == ref


def test_image_changes_the_answer_and_text_rows_stay(model):
    d, _, _, ours = model("init_siglip_qwen3")
    images = sample_images()
    ids, first = ours_inputs(d, ours, ONE_IMAGE, images[:1])
    _, other = ours_inputs(d, ours, ONE_IMAGE, images[1:2])
    a, b = ours.prefill_logits([ids, ids], images=[first, other])
    assert np.abs(a - b).max() > 1e-2  # the embeddings reach the language model


def test_batch_with_text_prompt_and_chunked_prefill_equal_one_prefill(model):
    d, _, _, ours = model("hf_clip_mixtral")
    ids, pixels = ours_inputs(d, ours, TWO_IMAGES, sample_images()[:2])
    alone = ours.prefill_logits([ids], images=[pixels])[0]
    text = [5, 17, 99, 3]
    batched = ours.prefill_logits([text, ids], images=[None, pixels])
    assert np.abs(batched[1] - alone).max() < 1e-4
    assert np.abs(batched[0] - ours.prefill_logits([text])[0]).max() < 1e-4
    # a chunked prefill: each chunk carries only the image rows inside it
    whole = ours.image_embeds([ids], [pixels])
    cut = len(ids) // 2 + 3
    for start, stop in ((0, cut), (cut, len(ids))):
        inside = (whole["embed_rows"] >= start) & (whole["embed_rows"] < stop)
        out = ours.step(StepBatch(slots=[2], starts=[start], lengths=[stop - start], tokens=ids[start:stop],
                                  embeds=whole["embeds"][inside], embed_rows=whole["embed_rows"][inside] - start),
                        want_logits=True)
    assert np.abs(out.logits[0] - alone).max() < 1e-4
