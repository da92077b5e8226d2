"""The forward pass must not depend on what is resident: greedy tokens and logprobs are identical
with every expert cached and with a cache of 10% of them (eviction on nearly every layer)."""
import numpy as np

from moebus.workers.local import LocalModel


def small_cache_model(model_dir, fraction: float) -> LocalModel:
    return LocalModel(model_dir, device="cpu", cache_fraction=fraction)


def test_greedy_tokens_and_logprobs_identical_at_100_and_10_percent(model_dirs):
    full = LocalModel(model_dirs["init_qwen3"], device="cpu")
    small = small_cache_model(model_dirs["init_qwen3"], 0.10)
    cache = small.stages[0].experts
    assert cache.num_slots < 0.2 * 8 * 4  # 8 experts x 4 layers: really a small cache
    prompt = [5, 17, 99, 3, 42, 7, 250, 31, 8]
    a, b = full.generate(prompt, 24), small.generate(prompt, 24)
    assert a.tokens == b.tokens
    assert np.array_equal(np.array(a.logprobs), np.array(b.logprobs))
    assert cache.misses > cache.num_slots  # it really evicted and reloaded


def test_long_prefill_borrows_from_the_cache_and_runs_in_pieces(model_dirs):
    """A prompt longer than the standing scratch covers: the loan is bounded by the cache, the
    stage runs in pieces, and logits equal those of one unconstrained pass."""
    from moebus.workers.batch import StepBatch
    from moebus.workers.cache_sizing import ScratchBudget

    full = LocalModel(model_dirs["init_qwen3"], device="cpu")
    small = small_cache_model(model_dirs["init_qwen3"], 0.5)
    stage = small.stages[0]
    stage.scratch = ScratchBudget(stage.cfg, tokens=4)
    cache = stage.experts
    slots_before = cache.num_slots
    prompts = [list(range(3, 40)), [7, 8, 9, 10, 11]]
    batch = StepBatch(slots=[0, 1], starts=[0, 0], lengths=[len(p) for p in prompts], tokens=sum(prompts, []))
    lendable = (slots_before - cache.min_slots) * cache.arena.slot_bytes
    assert stage.scratch.tokens_within(lendable) < batch.num_tokens  # so it must run in pieces
    got = small.step(batch, want_logits=True).logits
    want = full.prefill_logits(prompts)
    assert np.abs(got - want).max() < 1e-4
    assert cache.loaned_from is None and cache.num_slots == slots_before  # the loan came back
    lo, hi = cache.lend(10 ** 9)  # a loan never takes the slots one expert group needs
    assert cache.num_slots == cache.min_slots and hi - lo == slots_before - cache.min_slots
    cache.end_loan()
