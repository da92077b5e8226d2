"""A VRAM request gives the step pool's idle buffers back before it reads the free memory: a long step's
(an image's prompt grew the H200 worker's pool by ~470 MiB, twenty-fifth session) would otherwise stay
charged to the GPU's budget, the regrow to the start-up size overshoot it by as much, and the next
hand-back's first requests release two to three times what they ask. The cuda backend under the
simulator here (its pool is the real one); the last step's own buffers stay."""
import numpy as np
import pytest

from moebus.common.protocol import Vram
from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel
from tests.cuda.test_e2e import init_micro


class NoLink:
    generation = "g"
    dropped_messages = 0

    def peek(self, timeout_s):  # the hand-back beside the next step looks for a step queued: none
        return None


@pytest.fixture(scope="module")
def micro4(tmp_path_factory):
    return init_micro(tmp_path_factory, "micro4", num_hidden_layers=4)


def test_a_vram_request_releases_what_a_long_step_left_in_the_step_pool(micro4, monkeypatch):
    from moebus.workers import gpu_worker

    monkeypatch.setattr(gpu_worker, "INFO_AT_RESERVE", "driver")  # no driver figures kept (the simulator has none)
    stage = LocalModel(micro4, device="cuda", parts=2, num_slots=2, max_context=32, elastic=True).stages[0]
    stage.experts.arena.memory_info = lambda: (1 << 30, 1 << 34)  # the simulator's driver reports no figures
    pool = stage.ops.device_pool
    short = StepBatch(slots=[0, 1], starts=[0, 0], lengths=[1, 1], tokens=[5, 17])
    stage.forward(short)
    stage.ops.synchronize()
    held_by_short = pool.allocated_bytes
    stage.forward(StepBatch(slots=[0, 1], starts=[0, 0], lengths=[20, 12], tokens=np.arange(32) % 50 + 3))
    stage.forward(short)  # the long step's larger buffers now sit idle in the pool
    stage.ops.synchronize()
    grown = pool.allocated_bytes
    assert grown > held_by_short
    worker = gpu_worker.GpuWorker(stage, NoLink(), gpu=0)
    assert worker.vram(Vram(id="q", reserve_mib=0.0, query=True)).error is None
    assert pool.allocated_bytes == grown  # a query changes nothing
    assert worker.vram(Vram(id="r", reserve_mib=0.0)).error is None
    assert pool.allocated_bytes <= held_by_short  # what the last (short) step took stays, the rest went back
    stage.forward(short)
    after = stage.forward(short).hidden
    stage.forward(StepBatch(slots=[0, 1], starts=[0, 0], lengths=[20, 12], tokens=np.arange(32) % 50 + 3))
    stage.forward(short)
    assert worker.vram(Vram(id="b", reserve_mib=None)).error is None  # the regrow too
    assert pool.allocated_bytes <= held_by_short
    assert np.isfinite(after).all()
