"""``max_prefill_tokens_beside_decode``: while a sequence decodes, a long prompt is read in chunks of
at most that many tokens (its steps stay short); with nobody decoding it takes the whole step budget,
and unset, the scheduler plans exactly as before."""
import pytest

from moebus.broker.scheduler import Scheduler
from moebus.common.tokenizer import TextTokenizer
from tests.broker.test_scheduler import seq


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return TextTokenizer(tiny_model)


def _decoding(s: Scheduler, tokenizer, *ids: str) -> list:
    """Sequences admitted, prefilled and decoding in ``s``."""
    decoders = [seq(tokenizer, sid, [5, 6], max_tokens=40) for sid in ids]
    for d in decoders:
        s.submit(d)
    s.advance(s.plan())
    for d in decoders:
        d.accept(30, 0.0)
    return decoders


def _chunks(s: Scheduler, long_id: str, decoders) -> list[int]:
    """The long prompt's chunk lengths, step by step until it samples; the decoders decode meanwhile."""
    lengths = []
    while True:
        step = s.plan()
        s.advance(step)
        for q, take in zip(step.seqs, step.samples):
            if take and q.id != long_id:
                q.accept(31, 0.0)
        row = [q.id for q in step.seqs].index(long_id)
        lengths.append(int(step.lengths[row]))
        assert sum(1 for q in step.seqs if q in decoders) == len(decoders)  # every decoder, every step
        if step.samples[row]:
            return lengths


def test_a_long_prompt_beside_decoding_sequences_takes_capped_chunks(tokenizer):
    s = Scheduler(max_batch=4, max_queue=4, max_step_tokens=16, max_prefill_tokens_beside_decode=4)
    decoders = _decoding(s, tokenizer, "a", "b")
    s.submit(seq(tokenizer, "long", range(10, 30)))  # 20 prompt tokens
    assert _chunks(s, "long", decoders) == [4, 4, 4, 4, 4]


def test_without_decoding_sequences_a_prompt_takes_the_whole_step_budget(tokenizer):
    s = Scheduler(max_batch=4, max_queue=4, max_step_tokens=16, max_prefill_tokens_beside_decode=4)
    s.submit(seq(tokenizer, "long", range(10, 30)))
    assert _chunks(s, "long", []) == [16, 4]


def test_unset_the_budget_is_the_step_less_its_decode_rows(tokenizer):
    s = Scheduler(max_batch=4, max_queue=4, max_step_tokens=16)
    decoders = _decoding(s, tokenizer, "a", "b")
    s.submit(seq(tokenizer, "long", range(10, 40)))  # 30 prompt tokens: 14 + 14 + 2 beside 2 decode rows
    assert _chunks(s, "long", decoders) == [14, 14, 2]


def test_a_cap_above_the_step_budget_changes_nothing(tokenizer):
    s = Scheduler(max_batch=4, max_queue=4, max_step_tokens=16, max_prefill_tokens_beside_decode=100)
    decoders = _decoding(s, tokenizer, "a")
    s.submit(seq(tokenizer, "long", range(10, 40)))
    assert _chunks(s, "long", decoders) == [15, 15]


def test_prompts_admitted_together_share_the_capped_budget(tokenizer):
    s = Scheduler(max_batch=4, max_queue=4, max_step_tokens=16, max_prefill_tokens_beside_decode=6)
    _decoding(s, tokenizer, "a")
    s.submit(seq(tokenizer, "p", range(10, 14)))
    s.submit(seq(tokenizer, "q", range(20, 30)))
    step = s.plan()
    assert [q.id for q in step.seqs] == ["a", "p", "q"] and step.lengths.tolist() == [1, 4, 2]


def test_decoders_in_another_micro_batch_cap_the_prompt_too(tokenizer):
    """Pipelined: the decoders' micro-batch is in flight (busy), and waits behind this one on a stage."""
    s = Scheduler(max_batch=4, max_queue=4, max_step_tokens=16, max_prefill_tokens_beside_decode=4)
    decoders = _decoding(s, tokenizer, "a", "b")
    s.submit(seq(tokenizer, "long", range(10, 30)))
    step = s.plan(busy={d.id for d in decoders}, num_groups=2)
    assert [q.id for q in step.seqs] == ["long"] and step.lengths.tolist() == [4]


def test_a_prompt_with_images_takes_the_whole_step_budget_beside_decoding_sequences(tokenizer, monkeypatch):
    """Its steps hold image embeddings and are never captured: small chunks would each pay an eager
    step (its copies are bounded by the chunk that spans steps instead)."""
    import numpy as np

    from moebus.common import image_steps

    monkeypatch.setattr(image_steps, "IMAGE_STEP_TOKENS", 0)  # (no more than max_step_tokens)
    s = Scheduler(max_batch=4, max_queue=4, max_step_tokens=16, max_prefill_tokens_beside_decode=4)
    decoders = _decoding(s, tokenizer, "a", "b")
    image = seq(tokenizer, "image", range(10, 30))
    image.embeds, image.embed_positions = np.zeros((3, 8), np.float32), np.array([2, 3, 4], np.int32)
    s.submit(image)
    assert _chunks(s, "image", decoders) == [14, 6]


def test_an_image_prompt_s_tokens_count_against_the_cap_of_a_text_prompt_beside_it(tokenizer):
    import numpy as np

    s = Scheduler(max_batch=4, max_queue=4, max_step_tokens=16, max_prefill_tokens_beside_decode=4)
    _decoding(s, tokenizer, "a")
    image = seq(tokenizer, "image", range(10, 14))
    image.embeds, image.embed_positions = np.zeros((1, 8), np.float32), np.array([1], np.int32)
    s.submit(image)
    s.submit(seq(tokenizer, "text", range(20, 30)))
    step = s.plan()
    assert [q.id for q in step.seqs] == ["a", "image"] and step.lengths.tolist() == [1, 4]  # the text waits


def test_auto_caps_on_cuda_only():
    from moebus.broker.scheduler import AUTO_PREFILL_TOKENS_BESIDE_DECODE_CUDA, prefill_tokens_beside_decode
    from moebus.common.settings import Settings

    assert Settings().max_prefill_tokens_beside_decode == "auto"
    assert prefill_tokens_beside_decode("auto", "cuda") == AUTO_PREFILL_TOKENS_BESIDE_DECODE_CUDA == 16
    assert prefill_tokens_beside_decode("auto", "cpu") is None
    assert prefill_tokens_beside_decode(64, "cuda") == 64 and prefill_tokens_beside_decode(None, "cuda") is None


def test_with_image_step_tokens_an_image_prompt_s_step_grows_past_max_step_tokens_and_others_wait(tokenizer,
                                                                                                  monkeypatch):
    """MOEBUS_IMAGE_STEP_TOKENS (common/image_steps.py): an image prompt's step may take that many
    tokens less the decode rows; a text prompt beside it gets nothing more than it would have."""
    import numpy as np

    from moebus.common import image_steps

    monkeypatch.setattr(image_steps, "IMAGE_STEP_TOKENS", 40)
    s = Scheduler(max_batch=4, max_queue=4, max_step_tokens=16, max_prefill_tokens_beside_decode=4)
    decoders = _decoding(s, tokenizer, "a", "b")
    image = seq(tokenizer, "image", range(10, 60))
    image.embeds, image.embed_positions = np.zeros((3, 8), np.float32), np.array([2, 3, 4], np.int32)
    s.submit(image)
    s.submit(seq(tokenizer, "text", range(20, 30)))
    step = s.plan()
    assert [q.id for q in step.seqs] == ["a", "b", "image"] and step.lengths.tolist() == [1, 1, 38]
    s.advance(step)
    for q in decoders:
        q.accept(31, 0.0)
    step = s.plan()  # the rest of the image prompt (12, past the text prompt's cap of 4: it waits again)
    assert [q.id for q in step.seqs] == ["a", "b", "image"] and step.lengths.tolist() == [1, 1, 12]
    monkeypatch.setattr(image_steps, "IMAGE_STEP_TOKENS", 0)  # off: max_step_tokens, as before
    assert image_steps.image_step_tokens(16) == 16
