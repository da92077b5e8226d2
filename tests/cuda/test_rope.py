import numpy as np

from moebus.cuda.kernels.rope import rope_cuda, rope_ref, rope_tables
from tests.cuda.conftest import device, poisoned


def test_rope_matches_ref(rng):
    cos, sin = rope_tables(16, 10000.0, 64)
    x = rng.standard_normal((3, 2, 16), dtype=np.float32)
    positions = np.array([0, 7, 63], np.int32)
    out = poisoned(x.shape)
    rope_cuda(device(x), device(positions), device(cos), device(sin), out)
    np.testing.assert_allclose(out.copy_to_host(), rope_ref(x, positions, cos, sin), rtol=1e-5, atol=1e-5)
