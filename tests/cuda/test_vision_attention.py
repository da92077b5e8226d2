import numpy as np
import pytest

from moebus.cuda.kernels.vision_attention import vision_attention_cuda, vision_attention_ref
from tests.cuda.conftest import device, poisoned


@pytest.mark.parametrize("images, positions, heads, head_dim", [(2, 5, 2, 8), (1, 37, 1, 4), (2, 3, 1, 40)])
def test_vision_attention_matches_ref(rng, images, positions, heads, head_dim):
    shape = (images * positions, heads, head_dim)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    out = poisoned(shape)
    vision_attention_cuda(device(q), device(k), device(v), images, head_dim ** -0.5, out)
    np.testing.assert_allclose(out.copy_to_host(), vision_attention_ref(q, k, v, images, head_dim ** -0.5),
                               rtol=1e-5, atol=1e-5)


def test_vision_attention_ref_matches_torch_sdpa(rng):
    torch = pytest.importorskip("torch")
    q, k, v = (rng.standard_normal((2 * 6, 3, 4), dtype=np.float32) for _ in range(3))
    t = [torch.tensor(a).reshape(2, 6, 3, 4).transpose(1, 2) for a in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*t).transpose(1, 2).reshape(12, 3, 4)
    np.testing.assert_allclose(vision_attention_ref(q, k, v, 2, 0.5), ref.numpy(), rtol=1e-5, atol=1e-5)


def test_images_do_not_see_each_other(rng):
    q, k, v = (rng.standard_normal((8, 1, 4), dtype=np.float32) for _ in range(3))
    alone = vision_attention_ref(q[:4], k[:4], v[:4], 1, 0.5)
    np.testing.assert_allclose(vision_attention_ref(q, k, v, 2, 0.5)[:4], alone, rtol=1e-6)


def test_the_gpu_block_gives_the_same_result(rng, monkeypatch):
    from moebus.cuda.kernels import vision_attention

    monkeypatch.setattr(vision_attention, "WARPS", 8)  # what a real GPU runs: 8 query rows per block
    q, k, v = (rng.standard_normal((2 * 11, 2, 72), dtype=np.float32) for _ in range(3))
    out = poisoned(q.shape)
    vision_attention_cuda(device(q), device(k), device(v), 2, 72 ** -0.5, out)
    np.testing.assert_allclose(out.copy_to_host(), vision_attention_ref(q, k, v, 2, 72 ** -0.5), rtol=1e-5, atol=1e-5)
