"""A GPU with room beyond a cache of every expert: the standing step scratch grows into that room,
so prefill steps up to max_step_tokens run without the prompt-path loan (which evicts experts)."""
from __future__ import annotations

from moebus.workers.cache_sizing import ScratchBudget, widened


def test_the_standing_scratch_grows_into_spare_vram_up_to_the_largest_step():
    scratch = ScratchBudget.measured(tokens=8, standing_bytes=1000, per_token_bytes=10)
    wide = widened(scratch, spare_bytes=100_000, max_step_tokens=512)
    assert (wide.tokens, wide.standing_bytes, wide.per_token_bytes) == (512, 1000 + 504 * 10, 10)
    part = widened(scratch, spare_bytes=995, max_step_tokens=512)  # room for 99 tokens more
    assert (part.tokens, part.standing_bytes) == (107, 1000 + 99 * 10)
    assert part.bytes_for(200) == scratch.bytes_for(200)  # a longer step borrows the same in total
    for spare in (0, -5000, 9):  # no room (or less than a token's): the measured scratch as it was
        assert widened(scratch, spare, 512) is scratch
