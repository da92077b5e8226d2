"""An image's attention on the tensor-core path (prefill_attention.image_attention: the products on
cuBLAS, the unmasked row softmax of attention_parts as probability triples) against
vision_attention_ref."""
import numpy as np

from moebus.cuda.kernels import prefill_attention
from moebus.cuda.kernels.vision_attention import vision_attention_ref
from tests.cuda.conftest import device


def test_image_attention_on_tensor_cores_matches_ref(rng):
    from moebus.cuda.backends.cuda import CudaBackend
    from moebus.cuda.kernels.compat import SIMULATOR
    from moebus.cuda.kernels.gemm import TensorCores
    from moebus.cuda.kernels.gemm_host import HostBlas, cublas_blas

    ops = CudaBackend()
    tc = TensorCores(HostBlas() if SIMULATOR else cublas_blas(), min_rows=1)
    images, positions, heads, head_dim = 2, 9, 2, 8
    q, k, v = (rng.standard_normal((images * positions, heads, head_dim), dtype=np.float32) for _ in range(3))
    out = ops.empty(q.shape)
    prefill_attention.image_attention(ops, tc, device(q), device(k), device(v), images, head_dim ** -0.5, out)
    np.testing.assert_allclose(ops.to_host(out), vision_attention_ref(q, k, v, images, head_dim ** -0.5),
                               rtol=1e-4, atol=1e-5)
