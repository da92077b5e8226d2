"""A STEP's ``held_row`` (issue 20): the chunk a worker holds part-done goes again without its image
rows and, in a look-ahead step (``tokens_from``), without its ids; the worker takes them from what the
chunk kept at its first step, so the step's batch is the one the full feed would have made."""
from types import SimpleNamespace

import numpy as np
import pytest

from moebus.common.protocol import Step
from moebus.workers.batch import StepBatch
from moebus.workers.gpu_worker import GpuWorker
from moebus.workers.spanning_chunk import ChunkInProgress

D = 8


def full_step(step_id: int = 5) -> Step:
    """a decodes (slot 2, at 41); b's chunk of 6 tokens (slot 1, from 0), tokens 2..4 an image's."""
    return Step(step_id=step_id, slots=np.array([2, 1], np.int32), starts=np.array([41, 0], np.int32),
                lengths=np.array([1, 6], np.int32), tokens=np.array([9, 3, 4, 5, 6, 7, 8], np.int32),
                u=np.array([0.25, 0.5], np.float32), embeds=np.arange(3 * D, dtype=np.float32).reshape(3, D),
                embed_rows=np.array([3, 4, 5], np.int32))


def worker_holding(first: Step) -> GpuWorker:
    worker = GpuWorker.__new__(GpuWorker)
    worker.stage = SimpleNamespace(chunk=None, is_first=True, is_last=True)
    worker.last_step_id, worker.last_tokens = 4, np.array([9, 0], np.int32)
    batch = worker.batch_of(first, first.tokens)
    worker.stage.chunk = ChunkInProgress.of(batch, 1)  # as spanning_chunk.forward keeps it
    return worker


def same(a: StepBatch, b: StepBatch) -> None:
    for name in ("slots", "starts", "lengths", "tokens", "u"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    order_a, order_b = np.argsort(a.embed_rows), np.argsort(b.embed_rows)
    assert np.array_equal(a.embed_rows[order_a], b.embed_rows[order_b])
    assert np.array_equal(a.embeds[order_a], b.embeds[order_b])


def test_an_ordinary_step_naming_the_held_row_makes_the_full_feeds_batch():
    first = full_step()
    worker = worker_holding(first)
    again = first.model_copy(update=dict(step_id=6, embeds=None, embed_rows=None, held_row=1))
    same(worker.batch_of(again, again.tokens), worker.batch_of(first, first.tokens))


def test_a_look_ahead_step_takes_the_held_rows_ids_too():
    first = full_step()
    worker = worker_holding(first)
    ahead = Step(step_id=6, tokens_from=4, tokens_rows=np.array([0, 0], np.int32), held_row=1, slots=first.slots,
                 starts=first.starts, lengths=first.lengths, u=first.u)
    same(worker.batch_of(ahead, worker.tokens_of(ahead)), worker.batch_of(first, first.tokens))


def test_an_image_row_of_another_row_travels_beside_the_held_ones():
    first = full_step()
    worker = worker_holding(first)
    mixed = Step(step_id=6, slots=np.array([2, 1], np.int32), starts=np.array([0, 0], np.int32),
                 lengths=np.array([2, 6], np.int32), tokens=np.array([1, 2, 3, 4, 5, 6, 7, 8], np.int32),
                 embeds=np.full((1, D), -1.0, np.float32), embed_rows=np.array([1], np.int32), held_row=1)
    batch = worker.batch_of(mixed, mixed.tokens)
    assert sorted(batch.embed_rows.tolist()) == [1, 4, 5, 6] and batch.embeds[0, 0] == -1.0


@pytest.mark.parametrize("update", [dict(starts=np.array([41, 6], np.int32)), dict(slots=np.array([2, 3], np.int32)),
                                    dict(tokens=np.array([9, 3, 4, 5, 6, 7, 1], np.int32))])
def test_a_step_naming_a_chunk_the_worker_does_not_hold_fails(update):
    first = full_step()
    worker = worker_holding(first)
    other = first.model_copy(update=dict(step_id=6, embeds=None, embed_rows=None, held_row=1, **update))
    with pytest.raises(ValueError, match="does not hold"):
        worker.batch_of(other, other.tokens)
    worker.stage.chunk = None
    with pytest.raises(ValueError, match="does not hold"):
        worker.batch_of(first.model_copy(update=dict(held_row=1)), first.tokens)
