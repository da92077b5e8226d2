"""Greedy output is the same through the service (HTTP and ZeroMQ), in this process
(LocalModel.generate) and in transformers, on the same tiny model."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from moebus.workers.local import LocalModel
from tests.models import hf_greedy  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 42, 7, 250], list(range(30, 70))]
NUM_TOKENS = 24
MESSAGES = [{"role": "user", "content": "Which expert serves this token?"}]


@pytest.fixture(scope="module")
def local(tiny_model):
    return LocalModel(tiny_model, device="cpu", num_slots=1, max_context=256)


@pytest.fixture(scope="module")
def hf(tiny_model):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_token_prompt_greedy_equals_local_and_transformers(prompt, local, hf, openai_client, zmq_client, tokenizer):
    expected = local.generate(prompt, NUM_TOKENS)
    assert not set(expected.tokens) & tokenizer.stop_ids  # the comparison below needs no early stop
    assert expected.tokens == hf_greedy(hf, prompt, NUM_TOKENS)

    through_zmq = zmq_client.generate(prompt_tokens=prompt, max_tokens=NUM_TOKENS, temperature=0).collect()
    assert through_zmq["tokens"] == expected.tokens
    assert through_zmq["logprobs"] == pytest.approx(expected.logprobs, abs=1e-4)

    out = openai_client.completions.create(model="m", prompt=prompt, max_tokens=NUM_TOKENS, temperature=0, logprobs=1)
    choice = out.choices[0]
    assert choice.text == tokenizer.decode(expected.tokens)
    assert choice.logprobs.token_logprobs == pytest.approx(expected.logprobs, abs=1e-4)
    assert out.usage.completion_tokens == NUM_TOKENS


def test_chat_greedy_equals_local(local, openai_client, zmq_client, tokenizer):
    prompt = tokenizer.encode_chat(MESSAGES)
    expected = local.generate(prompt, NUM_TOKENS, stop_ids=tokenizer.stop_ids)
    text_ids = [t for t in expected.tokens if t not in tokenizer.stop_ids]

    through_zmq = zmq_client.chat(MESSAGES, max_tokens=NUM_TOKENS, temperature=0).collect()
    assert through_zmq["tokens"] == expected.tokens

    out = openai_client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=NUM_TOKENS, temperature=0)
    assert out.choices[0].message.content == tokenizer.decode(text_ids)
    assert out.choices[0].finish_reason == expected.finish_reason
    streamed = openai_client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=NUM_TOKENS,
                                                     temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == tokenizer.decode(text_ids)
