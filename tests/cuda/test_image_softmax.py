"""The row softmax of an image's attention on the tensor-core path (vision_attention.softmax_triples):
against its numpy reference and the masked softmax it replaces for unmasked rows, in the probability
triples (hi, hi, lo) that prefill_attention's P V product reads; then image_attention through it
against vision_attention_ref, both ways."""
import numpy as np
import pytest

from moebus.cuda.dtypes import bf16_to_f32
from moebus.cuda.kernels import prefill_attention
from moebus.cuda.kernels.attention_parts import masked_softmax_ref
from moebus.cuda.kernels.vision_attention import softmax_triples_cuda, softmax_triples_ref, vision_attention_ref
from tests.cuda.conftest import device


def _probabilities(triples: np.ndarray) -> np.ndarray:
    """hi + lo of (..., 3) triples, after checking the two hi copies agree."""
    np.testing.assert_array_equal(triples[..., 0], triples[..., 1])
    return bf16_to_f32(triples[..., 0]) + bf16_to_f32(triples[..., 2])


@pytest.mark.parametrize("rows, num_keys, pitch", [(5, 37, 48), (3, 7, 16), (4, 64, 64)])
def test_softmax_triples_match_ref_and_leave_the_padding(rng, rows, num_keys, pitch):
    scores = (4 * rng.standard_normal((rows, pitch))).astype(np.float32)
    out = device(np.full(3 * rows * pitch, 0xFFFF, np.uint16))
    softmax_triples_cuda(device(scores.ravel()), rows, num_keys, pitch, out)
    got = out.copy_to_host().reshape(rows, pitch, 3)
    assert (got[:, num_keys:] == 0xFFFF).all()  # the padding keys are not written
    want = softmax_triples_ref(scores, num_keys)
    # an ulp of p apart (the simulator's exp vs numpy's, the sum's order) can move lo by its own ulp, 2^-17 p
    np.testing.assert_allclose(_probabilities(got[:, :num_keys]), _probabilities(want), rtol=3e-5, atol=1e-9)
    exact = masked_softmax_ref(scores[None, :, :num_keys], 0, 0, False)[0]
    np.testing.assert_allclose(_probabilities(want), exact, rtol=3e-5, atol=1e-9)  # the split keeps ~2^-17


def test_softmax_triples_refuse_bad_sizes():
    scores, out = device(np.zeros(32, np.float32)), device(np.zeros(96, np.uint16))
    with pytest.raises(ValueError, match="keys"):
        softmax_triples_cuda(scores, 2, 17, 16, out)
    with pytest.raises(ValueError, match="shorter"):
        softmax_triples_cuda(scores, 3, 16, 16, out)


@pytest.mark.parametrize("softmax", ["warps", "blocks"])
def test_image_attention_on_tensor_cores_matches_ref(rng, monkeypatch, softmax):
    from moebus.cuda.backends.cuda import CudaBackend
    from moebus.cuda.kernels.compat import SIMULATOR
    from moebus.cuda.kernels.gemm import TensorCores
    from moebus.cuda.kernels.gemm_host import HostBlas, cublas_blas

    monkeypatch.setattr(prefill_attention, "IMAGE_SOFTMAX", softmax)
    ops = CudaBackend()
    tc = TensorCores(HostBlas() if SIMULATOR else cublas_blas(), min_rows=1)
    images, positions, heads, head_dim = 2, 9, 2, 8
    q, k, v = (rng.standard_normal((images * positions, heads, head_dim), dtype=np.float32) for _ in range(3))
    out = ops.empty(q.shape)
    prefill_attention.image_attention(ops, tc, device(q), device(k), device(v), images, head_dim ** -0.5, out)
    np.testing.assert_allclose(ops.to_host(out), vision_attention_ref(q, k, v, images, head_dim ** -0.5),
                               rtol=1e-4, atol=1e-5)
