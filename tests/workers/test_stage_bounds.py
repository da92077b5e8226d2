"""A stage refuses a step that names a KV slot or a position it does not have, before touching memory."""
import numpy as np
import pytest

from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel


@pytest.fixture(scope="module")
def model(tiny_model):
    return LocalModel(tiny_model, num_slots=2, max_context=32)


@pytest.mark.parametrize("slots,starts,match", [
    ([2], [0], "KV slot"), ([-1], [0], "KV slot"), ([0], [40], "max_context")])
def test_out_of_range_slots_and_positions_are_refused(model, slots, starts, match):
    batch = StepBatch(slots=np.array(slots), starts=np.array(starts), lengths=np.ones(1), tokens=np.array([3]),
                      temperature=np.zeros(1, np.float32), top_k=np.zeros(1), top_p=np.ones(1, np.float32),
                      u=np.zeros(1, np.float32))
    with pytest.raises(ValueError, match=match):
        model.stages[0].forward(batch)
