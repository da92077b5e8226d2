"""Model fidelity: our logits and greedy continuations against transformers on the same weights."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from moebus.workers.batch import StepBatch  # noqa: E402
from moebus.workers.local import LocalModel  # noqa: E402
from tests.models import hf_greedy  # noqa: E402

MODELS = ["init_qwen3", "init_mixtral", "hf_qwen3_bf16", "hf_qwen3_f32", "hf_mixtral_bf16", "hf_mixtral_f16"]
PROMPTS = [[5, 17, 99, 3, 42, 7, 250], [11, 12], list(range(30, 70)), [200]]


@pytest.fixture(scope="module")
def pair(request, model_dirs):
    cache = {}

    def get(name):
        if name not in cache:
            hf = transformers.AutoModelForCausalLM.from_pretrained(model_dirs[name], dtype=torch.float32).eval()
            cache[name] = (hf, LocalModel(model_dirs[name], device="cpu", num_slots=8, max_context=256))
        return cache[name]

    return get


def hf_last_logits(hf, prompt):
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, -1].numpy()


@pytest.mark.parametrize("name", MODELS)
def test_batch_of_unequal_prompts_matches_transformers(pair, name):
    hf, ours = pair(name)
    logits = ours.prefill_logits(PROMPTS)
    for prompt, row in zip(PROMPTS, logits):
        ref = hf_last_logits(hf, prompt)
        assert np.abs(row - ref).max() < 1e-3
        assert np.abs(ref).max() > 1.0  # the comparison is not between near-zero vectors


@pytest.mark.parametrize("name", MODELS)
def test_greedy_32_tokens_identical(pair, name):
    hf, ours = pair(name)
    prompt = PROMPTS[0]
    assert ours.generate(prompt, 32).tokens == hf_greedy(hf, prompt, 32)


@pytest.mark.parametrize("name", ["init_qwen3", "hf_mixtral_bf16"])
def test_decode_with_kv_cache_equals_prefill_of_longer_sequence(pair, name):
    _, ours = pair(name)
    prompt, extra = PROMPTS[2], [7, 8, 9]
    ours.step(StepBatch(slots=[3], starts=[0], lengths=[len(prompt)], tokens=prompt))
    start = len(prompt)
    for i, token in enumerate(extra):
        out = ours.step(StepBatch(slots=[3], starts=[start + i], lengths=[1], tokens=[token]), want_logits=True)
    full = ours.prefill_logits([prompt + extra])
    assert np.abs(out.logits[0] - full[0]).max() < 1e-4


def test_logprobs_are_log_softmax_of_raw_logits(pair):
    hf, ours = pair("init_qwen3")
    gen = ours.generate(PROMPTS[1], 1)
    ref = torch.log_softmax(torch.tensor(hf_last_logits(hf, PROMPTS[1]), dtype=torch.float64), -1)
    assert abs(gen.logprobs[0] - float(ref[gen.tokens[0]])) < 1e-4
