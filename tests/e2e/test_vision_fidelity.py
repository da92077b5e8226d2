"""An image chat through the openai SDK against a real ``moebus serve`` (lazy vision: the first
image starts the vision worker) gives transformers' LlavaForConditionalGeneration's greedy tokens
and log-probabilities, for a SigLIP and a CLIP tower saved by save_pretrained with LlavaProcessor;
and so does the same request over ZeroMQ with the image as a raw frame."""
import io

import numpy as np
import openai
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from moebus.client import Client  # noqa: E402
from tests.e2e.vision_helpers import data_url, image_message, png_bytes, start_vision_service  # noqa: E402
from tests.vision_models import make_hf_llava, sample_images  # noqa: E402

NUM_TOKENS = 8
TEXT = "What is in the picture?"
TOWERS = {"siglip": dict(tower="siglip"), "clip": dict(tower="clip", text_arch="mixtral")}
# siglip_chunked: prompts prefill in 7-token chunks, so an image's 16 tokens span three STEPs
SERVES = {"siglip": {}, "clip": {}, "siglip_chunked": {"max_step_tokens": 7}}


@pytest.fixture(scope="module", params=list(SERVES))
def llava(request, tmp_path_factory, tiny_llava):
    tmp = tmp_path_factory.mktemp(f"vision-{request.param}")
    tower = request.param.split("_")[0]
    model_dir = tiny_llava if tower == "siglip" else make_hf_llava(tmp / "model", **TOWERS[tower])
    svc = start_vision_service(tmp, model_dir, **SERVES[request.param])
    try:
        yield model_dir, svc
    finally:
        assert svc.stop() == []


def hf_reference(model_dir, images: list[bytes], text: str, num_tokens: int):
    """transformers' greedy tokens and their log-probabilities for the same chat (eos switched off)."""
    from PIL import Image

    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    prompt = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                     add_generation_prompt=True)
    pil = [Image.open(io.BytesIO(b)) for b in images]
    inputs = processor(images=pil, text=prompt, return_tensors="pt")
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=num_tokens, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)
    prompt_len = inputs["input_ids"].shape[1]
    tokens = out.sequences[0, prompt_len:].tolist()
    logprobs = [float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.logits, tokens)]
    return prompt_len, tokens, logprobs


@pytest.mark.parametrize("num_images", [1, 2])
def test_image_chat_equals_transformers(llava, num_images):
    model_dir, svc = llava
    images = [png_bytes(im) for im in sample_images()[:num_images]]
    prompt_len, ref_tokens, ref_logprobs = hf_reference(model_dir, images, TEXT, NUM_TOKENS)
    with openai.OpenAI(base_url=svc.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        reply = client.chat.completions.create(model="m", messages=image_message([data_url(b) for b in images], TEXT),
                                               max_tokens=NUM_TOKENS, temperature=0, logprobs=True,
                                               extra_body={"ignore_eos": True})
    assert reply.usage.prompt_tokens == prompt_len  # each <image> expanded as LlavaProcessor does
    zmq = Client(svc.zmq_address, timeout_s=60)
    try:
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": TEXT}]
        ours = zmq.chat([{"role": "user", "content": content}], images=images, max_tokens=NUM_TOKENS, temperature=0,
                        ignore_eos=True, logprobs=1).collect()
    finally:
        zmq.close()
    assert ours["tokens"] == ref_tokens
    logprobs = [t.logprob for t in reply.choices[0].logprobs.content]
    assert np.abs(np.array(logprobs) - ref_logprobs).max() <= 1e-3
    assert np.abs(np.array(ours["logprobs"]) - ref_logprobs).max() <= 1e-3


def test_the_image_matters(llava):
    """Another picture, the same text: other log-probabilities (the embeddings reach the model)."""
    _, svc = llava
    zmq = Client(svc.zmq_address, timeout_s=60)
    try:
        content = [{"type": "image"}, {"type": "text", "text": TEXT}]
        runs = [zmq.chat([{"role": "user", "content": content}], images=[png_bytes(im)], max_tokens=2, temperature=0,
                         ignore_eos=True).collect()["logprobs"] for im in sample_images()[:2]]
    finally:
        zmq.close()
    assert abs(runs[0][0] - runs[1][0]) > 1e-3
