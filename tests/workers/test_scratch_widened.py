"""A GPU with room beyond a cache of every expert: the standing step scratch grows into that room,
so prefill steps up to max_step_tokens run without the prompt-path loan (which evicts experts)."""
from __future__ import annotations

from moebus.workers.cache_sizing import ScratchBudget, widened


class NoLink:
    generation = "g"
    dropped_messages = 0

    def peek(self, timeout_s):  # the hand-back beside the next step looks for a step queued: none
        return None


def test_the_standing_scratch_grows_into_spare_vram_up_to_the_largest_step():
    scratch = ScratchBudget.measured(tokens=8, standing_bytes=1000, per_token_bytes=10)
    wide = widened(scratch, spare_bytes=100_000, max_step_tokens=512)
    assert (wide.tokens, wide.standing_bytes, wide.per_token_bytes) == (512, 1000 + 504 * 10, 10)
    part = widened(scratch, spare_bytes=995, max_step_tokens=512)  # room for 99 tokens more
    assert (part.tokens, part.standing_bytes) == (107, 1000 + 99 * 10)
    assert part.bytes_for(200) == scratch.bytes_for(200)  # a longer step borrows the same in total
    for spare in (0, -5000, 9):  # no room (or less than a token's): the measured scratch as it was
        assert widened(scratch, spare, 512) is scratch


def test_a_vram_reserve_takes_long_steps_back_to_the_loan_and_bare_vram_widens_them_again(tiny_model, monkeypatch):
    """The room beside the cache is what a reserve hands out (to the vision worker): while one
    holds, a long step must not allocate there (MOEBUS_RESERVE_SCRATCH=measured)."""
    from moebus.common.protocol import Vram
    from moebus.workers import gpu_worker
    from moebus.workers.gpu_worker import GpuWorker

    monkeypatch.setattr(gpu_worker, "RESERVE_SCRATCH", "measured")
    from moebus.workers.local import LocalModel

    stage = LocalModel(tiny_model, num_slots=2, max_context=32).stages[0]
    measured = ScratchBudget.measured(tokens=2, standing_bytes=1000, per_token_bytes=10)
    wide = widened(measured, 10_000, 64)
    stage.scratch, stage.scratch_choices = wide, (measured, wide)
    worker = GpuWorker(stage, NoLink(), gpu=0)
    assert worker.vram(Vram(id="q", reserve_mib=0.0, query=True)).error is None and stage.scratch is wide
    worker.vram(Vram(id="r", reserve_mib=0.0))
    assert stage.scratch is measured
    worker.vram(Vram(id="b", reserve_mib=None))
    assert stage.scratch is wide


def test_with_reserve_scratch_beside_a_reserve_keeps_long_steps_beside_the_cache_where_room_is_left(tiny_model,
                                                                                                   monkeypatch):
    """MOEBUS_RESERVE_SCRATCH=beside: while a reserve holds, the measured scratch widened into what the
    device has free beyond the reserve and the headroom (none left: the measured one, the loan)."""
    from moebus.common import image_steps
    from moebus.common.protocol import Vram
    from moebus.workers import gpu_worker
    from moebus.workers.cache_sizing import CUDA_HEADROOM_BYTES
    from moebus.workers.local import LocalModel

    monkeypatch.setattr(gpu_worker, "RESERVE_SCRATCH", "beside")
    monkeypatch.setattr(image_steps, "IMAGE_STEP_TOKENS", 0)  # image steps no longer than any prompt's, first
    stage = LocalModel(tiny_model, num_slots=2, max_context=32).stages[0]
    measured = ScratchBudget.measured(tokens=2, standing_bytes=1000, per_token_bytes=10)
    wide = widened(measured, 10_000, 64)
    stage.scratch, stage.scratch_choices = wide, (measured, wide)
    stage.experts.arena.memory_info = lambda: (CUDA_HEADROOM_BYTES + 2 ** 30, 2 ** 34)  # a GiB beyond the headroom
    worker = gpu_worker.GpuWorker(stage, NoLink(), gpu=0)
    room_mib = 1024.0
    worker.vram(Vram(id="r", reserve_mib=0.0))
    assert stage.scratch.tokens == wide.tokens and stage.scratch.per_token_bytes == measured.per_token_bytes
    worker.vram(Vram(id="s", reserve_mib=room_mib + 1.0))  # the reserve takes the room: the loan again
    assert stage.scratch is measured
    monkeypatch.setattr(image_steps, "IMAGE_STEP_TOKENS", 128)  # an image prompt's steps may be longer
    worker.vram(Vram(id="i", reserve_mib=0.0))
    assert stage.scratch.tokens == 128 > wide.tokens
    worker.vram(Vram(id="b", reserve_mib=None))
    assert stage.scratch is wide
