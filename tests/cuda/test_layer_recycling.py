"""On the cuda backend (the simulator here) a step's buffers come back per layer: a prefill holds
fewer pool bytes than with per-step recycling alone and gives the same hidden states, and the
warm-up measurement reads the pool's peak. (A first stage of a two-stage split: no sampling
kernels, which the simulator runs slowly.)"""
import numpy as np
import pytest

from moebus.workers.batch import StepBatch
from moebus.workers.cache_sizing import measure_scratch
from moebus.workers.local import LocalModel
from tests.cuda.test_e2e import init_micro


@pytest.fixture(scope="module")
def micro6(tmp_path_factory):
    return init_micro(tmp_path_factory, "micro6", num_hidden_layers=4)


def test_per_layer_recycling_holds_less_changes_nothing_and_is_measured(micro6):
    per_layer = LocalModel(micro6, device="cuda", parts=2, num_slots=2, max_context=16).stages[0]
    per_step = LocalModel(micro6, device="cuda", parts=2, num_slots=2, max_context=16).stages[0]
    per_step.ops.recycle_layer = lambda mark, keep: None  # what the pool did before
    batch = StepBatch(slots=[0, 1], starts=[0, 0], lengths=[3, 2], tokens=[5, 17, 42, 9, 77])
    a, b = per_layer.forward(batch).hidden, per_step.forward(batch).hidden
    np.testing.assert_array_equal(a, b)
    held, held_before = per_layer.ops.device_pool.allocated_bytes, per_step.ops.device_pool.allocated_bytes
    assert held < 0.7 * held_before, (held, held_before)
    budget = measure_scratch(per_layer, 2, 3)
    assert budget.standing_bytes > 0 and budget.per_token_bytes > 0
    assert per_layer.ops.device_pool.allocated_bytes == 0  # the warm-up's buffers went back
