import numpy as np

from moebus.cuda.kernels.top_logprobs import top_logprobs_cuda, top_logprobs_rows_ref
from tests.cuda.conftest import device, poisoned


def test_top_logprobs_on_the_device_match_the_host_order_and_values(rng):
    logits = rng.integers(-6, 6, size=(3, 300)).astype(np.float32)  # many ties: lower id first
    logits[1] += rng.standard_normal(300, dtype=np.float32)
    ids, logprobs = poisoned((3, 7), np.int32), poisoned((3, 7))
    top_logprobs_cuda(device(logits), 7, ids, logprobs)
    want_ids, want_logprobs = top_logprobs_rows_ref(logits, 7)
    np.testing.assert_array_equal(ids.copy_to_host(), want_ids)
    np.testing.assert_allclose(logprobs.copy_to_host(), want_logprobs, rtol=1e-5, atol=1e-5)
