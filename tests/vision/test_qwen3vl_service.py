"""Qwen3-VL-MoE through a real ``moebus serve`` (two emulated GPUs, so the layer split puts the
DeepStack layers on both stages; lazy vision: the first image starts the vision worker; prompts
prefill in 16-token chunks, so an image's tokens, their M-RoPE positions and DeepStack rows span
several STEPs): chats with one image, two images of different sizes and none, through the openai
SDK and over ZeroMQ, give transformers' greedy tokens and log-probabilities; a video part is a 400."""
import io

import numpy as np
import openai
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from moebus.client import Client  # noqa: E402
from tests.e2e.vision_helpers import data_url, png_bytes, start_vision_service, vision_state  # noqa: E402
from tests.vision.qwen3vl_models import make_hf_qwen3vl, sample_images  # noqa: E402

NUM_TOKENS = 6
TEXT = "What is in the picture?"


@pytest.fixture(scope="module")
def qwen3vl(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwen3vl-serve")
    model_dir = make_hf_qwen3vl(tmp / "model")
    svc = start_vision_service(tmp, model_dir, max_step_tokens=16)
    try:
        yield model_dir, svc
    finally:
        assert svc.stop() == []


@pytest.fixture(scope="module")
def hf(qwen3vl):
    model = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(qwen3vl[0], dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_reference(model_dir, hf, images: list[bytes]):
    """transformers' prompt length, greedy tokens and their log-probabilities for the same chat."""
    from PIL import Image

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": TEXT}]
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    kwargs = {}
    if images:
        pix = transformers.Qwen2VLImageProcessorPil.from_pretrained(model_dir)(  # the PIL one, as moebus
            images=[Image.open(io.BytesIO(b)) for b in images], return_tensors="pt")
        parts = text.split("<|image_pad|>")
        text = parts[0] + "".join("<|image_pad|>" * (int(g.prod()) // 4) + rest
                                  for g, rest in zip(pix["image_grid_thw"], parts[1:]))
        kwargs = dict(pixel_values=pix["pixel_values"], image_grid_thw=pix["image_grid_thw"])
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(
            ids == hf.config.image_token_id).int(), max_new_tokens=NUM_TOKENS, do_sample=False, output_logits=True,
            return_dict_in_generate=True, **kwargs)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    return ids.shape[1], tokens, [float(torch.log_softmax(s[0], -1)[t]) for s, t in zip(out.logits, tokens)]


@pytest.mark.parametrize("num_images", [1, 2, 0])
def test_chat_equals_transformers(qwen3vl, hf, num_images):
    model_dir, svc = qwen3vl
    images = [png_bytes(im) for im in sample_images()[1 : 1 + num_images]]  # 40 x 70 and 90 x 50 px
    prompt_len, ref_tokens, ref_logprobs = hf_reference(model_dir, hf, images)
    parts = [{"type": "image_url", "image_url": {"url": data_url(b)}} for b in images]
    with openai.OpenAI(base_url=svc.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        reply = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": parts + [{"type": "text", "text": TEXT}]}],
            max_tokens=NUM_TOKENS, temperature=0, logprobs=True, extra_body={"ignore_eos": True})
    assert reply.usage.prompt_tokens == prompt_len  # <|image_pad|> expanded per image as Qwen3VLProcessor does
    logprobs = [t.logprob for t in reply.choices[0].logprobs.content]
    assert np.abs(np.array(logprobs) - ref_logprobs).max() <= 1e-3
    zmq = Client(svc.zmq_address, timeout_s=60)
    try:
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": TEXT}]
        ours = zmq.chat([{"role": "user", "content": content}], images=images or None, max_tokens=NUM_TOKENS,
                        temperature=0, ignore_eos=True, logprobs=1).collect()
        assert ours["tokens"] == ref_tokens
        assert np.abs(np.array(ours["logprobs"]) - ref_logprobs).max() <= 1e-3
        if images:
            assert vision_state(zmq)["starts"] >= 1
    finally:
        zmq.close()


def test_video_is_a_clear_400(qwen3vl):
    _, svc = qwen3vl
    zmq = Client(svc.zmq_address, timeout_s=30)
    try:
        content = [{"type": "video"}, {"type": "text", "text": TEXT}]
        with pytest.raises(Exception, match="video inputs are not supported"):
            zmq.chat([{"role": "user", "content": content}], max_tokens=2).collect()
    finally:
        zmq.close()
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    with openai.OpenAI(base_url=svc.base_url + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
        with pytest.raises(openai.BadRequestError, match="video"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": [video]}], max_tokens=2)


def test_n_choices_share_one_encode_with_its_deepstack(qwen3vl, hf):
    """n = 2: one encode (embeddings and DeepStack features shared), both choices transformers' tokens."""
    model_dir, svc = qwen3vl
    images = [png_bytes(sample_images()[2])]
    _, ref_tokens, _ = hf_reference(model_dir, hf, images)
    zmq = Client(svc.zmq_address, timeout_s=60)
    try:
        before = zmq.info()["counters"]
        with openai.OpenAI(base_url=svc.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            reply = client.chat.completions.create(
                model="m", n=2, max_tokens=NUM_TOKENS, temperature=0, logprobs=True, extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(images[0])}},
                                                       {"type": "text", "text": TEXT}]}])
        after = zmq.info()["counters"]
    finally:
        zmq.close()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert len(reply.choices) == 2
    for choice in reply.choices:
        assert choice.message.content == tok.decode(ref_tokens, skip_special_tokens=True)
    assert after["images_total"] - before["images_total"] == 1
    assert after["images_reused_total"] - before["images_reused_total"] == 1
