"""Every sampling field through the openai SDK against a real ``moebus serve``, streamed and not,
each checked against an independent oracle (tests/api/oracle.py) on the same weights."""
import numpy as np
import pytest

from tests.api.oracle import Oracle

PROMPT_TEXT = "The expert cache keeps the hot experts of every layer"
NUM_TOKENS = 16  # the tiny model first repeats a token at 8: penalties change the answer from there

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def oracle(tiny_model):
    return Oracle(tiny_model)


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer.encode(PROMPT_TEXT)


def complete(client, prompt, stream: bool, **kwargs):
    """The text of a greedy completion of token ids, whole or assembled from a stream."""
    args = dict(model="tiny", prompt=prompt, max_tokens=NUM_TOKENS, temperature=0, stream=stream, **kwargs)
    extra = {"ignore_eos": True, **args.pop("extra_body", {})}
    out = client.completions.create(**args, extra_body=extra)
    if not stream:
        assert out.usage.completion_tokens == NUM_TOKENS
        return out.choices[0].text
    return "".join(c.choices[0].text for c in out if c.choices)


CASES = {
    "frequency": ({"frequency_penalty": 1.5}, {"frequency": 1.5}),
    "presence": ({"presence_penalty": 2.0}, {"presence": 2.0}),
    "frequency_and_presence": ({"frequency_penalty": 0.7, "presence_penalty": 0.9},
                               {"frequency": 0.7, "presence": 0.9}),
    "repetition": ({"extra_body": {"repetition_penalty": 1.8}}, {"repetition": 1.8}),
    "all": ({"frequency_penalty": 0.5, "presence_penalty": 0.5, "extra_body": {"repetition_penalty": 1.3}},
            {"frequency": 0.5, "presence": 0.5, "repetition": 1.3}),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", list(CASES))
def test_penalties_follow_the_independent_definition(openai_client, oracle, tokenizer, prompt, case, stream):
    request, oracle_args = CASES[case]
    want = oracle.greedy(prompt, NUM_TOKENS, **oracle_args)
    assert want != oracle.greedy(prompt, NUM_TOKENS), "the penalty must change the answer for the test to mean much"
    assert complete(openai_client, prompt, stream, **request) == tokenizer.decode(want)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_logit_bias(openai_client, oracle, tokenizer, prompt, stream):
    plain = oracle.greedy(prompt, NUM_TOKENS)
    bias = {plain[0]: -100.0, plain[2]: -100.0, 60: 3.0}
    want = oracle.greedy(prompt, NUM_TOKENS, logit_bias=bias)
    got = complete(openai_client, prompt, stream, logit_bias={str(k): v for k, v in bias.items()})
    assert got == tokenizer.decode(want)
    forced = complete(openai_client, prompt, stream, logit_bias={"60": 100})
    assert forced == tokenizer.decode([60] * NUM_TOKENS)


def test_logit_bias_combines_with_penalties(openai_client, oracle, tokenizer, prompt):
    bias = {60: 8.0, 61: 7.0}
    want = oracle.greedy(prompt, NUM_TOKENS, frequency=1.0, presence=0.5, logit_bias=bias)
    got = complete(openai_client, prompt, False, frequency_penalty=1.0, presence_penalty=0.5,
                   logit_bias={str(k): v for k, v in bias.items()})
    assert got == tokenizer.decode(want)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_min_p_only_draws_tokens_it_allows(openai_client, oracle, prompt, stream):
    """Sampled at temperature 1.5 with min_p 0.3: every drawn token has p >= 0.3 p_max (transformers'
    MinPLogitsWarper decides), and min_p 0 with the same seed draws some it would not allow."""
    from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper

    from tests.api.oracle import hf_process

    def drawn(min_p) -> list[tuple[list[int], int]]:
        """(prefix, drawn id) per step; an id is told by its raw logprob, which the answer reports."""
        out = openai_client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=1.5, seed=11,
                                               logprobs=1, stream=stream,
                                               extra_body={"ignore_eos": True, "min_p": min_p})
        chunks = [out] if not stream else [c for c in out if c.choices and c.choices[0].logprobs]
        steps, ids = [], []
        for logprob in (lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs):
            raw = oracle.logits(prompt + ids).astype(np.float64)
            lse = raw.max() + np.log(np.exp(raw - raw.max()).sum())
            token = int(np.argmin(np.abs(raw - lse - logprob)))
            steps.append((list(ids), token))
            ids.append(token)
        return steps

    def allowed(prefix, token) -> bool:
        x = hf_process(TemperatureLogitsWarper(1.5), oracle.logits(prompt + prefix), [])
        return bool(np.isfinite(hf_process(MinPLogitsWarper(0.3), x, []))[token])

    assert all(allowed(*step) for step in drawn(0.3))
    assert not all(allowed(*step) for step in drawn(0.0))


def test_reported_logprobs_stay_those_of_the_raw_logits(openai_client, oracle, prompt):
    out = openai_client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, logprobs=1,
                                           logit_bias={"60": 100})
    raw = oracle.logits(prompt).astype(np.float64)
    lse = raw.max() + np.log(np.exp(raw - raw.max()).sum())
    assert out.choices[0].logprobs.token_logprobs[0] == pytest.approx(raw[60] - lse, abs=1e-4)


def test_chat_takes_the_same_fields(openai_client):
    args = dict(model="tiny", messages=[{"role": "user", "content": "Say one word."}], max_tokens=6, temperature=0,
                frequency_penalty=1.0, presence_penalty=0.5, logit_bias={"60": 100},
                extra_body={"ignore_eos": True, "repetition_penalty": 1.2, "min_p": 0.1})
    whole = openai_client.chat.completions.create(**args)
    chunks = openai_client.chat.completions.create(**args, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == streamed
