"""LayerNorm with each row held in registers (layernorm_held.py) equals layernorm.py's kernels bit for bit:
the plain norm, its split store (a product's input) and the residual add before it; rows wider than
the held limit keep layernorm.py's kernels."""
import numpy as np
import pytest

from moebus.cuda.kernels import layernorm_held
from moebus.cuda.kernels.layernorm import layernorm_cuda, residual_layernorm_cuda
from moebus.cuda.kernels.split_epilogues import layernorm_split_cuda
from tests.cuda.conftest import device, poisoned, stored

# widths: under a lane's first group, a partial last element group (170 = 5 x 32 + 10), a whole number of groups
WIDTHS = [24, 170, 256]


def _both(monkeypatch, run):
    """run() with layernorm.py's kernels, then with the held ones: both results as host arrays."""
    results = []
    for held in (False, True):
        monkeypatch.setattr(layernorm_held, "HELD", held)
        results.append(run())
    return results


def _inputs(rng, rows, dim, storage="bf16"):
    x = rng.standard_normal((rows, dim), dtype=np.float32) * 3 + 2  # an offset: the mean matters
    weight, bias = (stored(rng.standard_normal(dim, dtype=np.float32), storage) for _ in range(2))
    return x, weight, bias


@pytest.mark.parametrize("dim", WIDTHS)
@pytest.mark.parametrize("storage", ["bf16", "f32"])
def test_held_layernorm_equals_the_loop_kernel(rng, monkeypatch, dim, storage):
    x, weight, bias = _inputs(rng, 7, dim, storage)  # 7 rows over blocks of 4 warps: a warp past the last row
    loop, held = _both(monkeypatch, lambda: layernorm_cuda(device(x), device(weight), device(bias), 1e-6,
                                                           poisoned((7, dim))).copy_to_host())
    np.testing.assert_array_equal(held, loop)
    assert np.isfinite(held).all()


@pytest.mark.parametrize("dim", WIDTHS)
def test_held_layernorm_split_equals_the_loop_kernel(rng, monkeypatch, dim):
    x, weight, bias = _inputs(rng, 5, dim)
    loop, held = _both(monkeypatch, lambda: layernorm_split_cuda(
        device(x), device(weight), device(bias), 1e-6, device(np.full((2, 5, dim), 0xFFFF, np.uint16))).copy_to_host())
    np.testing.assert_array_equal(held, loop)


@pytest.mark.parametrize("dim", WIDTHS)
@pytest.mark.parametrize("parts", [0, 2])  # 0: a float32 result; 2: a product's split input
def test_held_residual_layernorm_equals_the_loop_kernel(rng, monkeypatch, dim, parts):
    x, weight, bias = _inputs(rng, 7, dim)
    y = rng.standard_normal((7, dim), dtype=np.float32)
    residual_bias = stored(rng.standard_normal(dim, dtype=np.float32), "bf16")

    def run():
        x_out = poisoned((7, dim))
        out = device(np.full((parts, 7, dim), 0xFFFF, np.uint16)) if parts else poisoned((7, dim))
        residual_layernorm_cuda(device(x), device(y), device(residual_bias), device(weight), device(bias), 1e-6,
                                x_out, out)
        return x_out.copy_to_host(), out.copy_to_host()

    (loop_x, loop_out), (held_x, held_out) = _both(monkeypatch, run)
    np.testing.assert_array_equal(held_x, loop_x)
    np.testing.assert_array_equal(held_out, loop_out)


@pytest.mark.parametrize("warps", [1, 2])
def test_held_blocks_of_fewer_warps_give_the_same_rows(rng, monkeypatch, warps):
    x, weight, bias = _inputs(rng, 7, 170)
    y = rng.standard_normal((7, 170), dtype=np.float32)
    monkeypatch.setattr(layernorm_held, "HELD", True)
    results = []
    for block_warps in (4, warps):
        monkeypatch.setattr(layernorm_held, "BLOCK_WARPS", block_warps)
        x_out, out = poisoned((7, 170)), device(np.full((2, 7, 170), 0xFFFF, np.uint16))
        residual_layernorm_cuda(device(x), device(y), device(bias), device(weight), device(bias), 1e-6, x_out, out)
        results.append((x_out.copy_to_host(), out.copy_to_host()))
    for got, want in zip(results[1], results[0]):
        np.testing.assert_array_equal(got, want)


def test_rows_past_the_held_limit_keep_the_loop_kernel(monkeypatch):
    monkeypatch.setattr(layernorm_held, "HELD", True)
    assert layernorm_held.per_lane(1152) == 36  # the towers' hidden rows
    assert layernorm_held.per_lane(32 * layernorm_held.MAX_PER_LANE + 1) == 0  # a DeepStack merger's 4608: too wide


@pytest.mark.parametrize("name", ["layernorm_held", "split_two_parts"])
def test_the_held_and_two_part_kernels_wait_first(name):
    """Behind a product in a captured tower the edge into them is programmatic (pdl.py): each waits first."""
    from tests.cuda import test_pdl

    test_pdl.test_every_kernel_of_the_decode_step_waits_first(name)
