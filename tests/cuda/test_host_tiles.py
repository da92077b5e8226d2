"""A long step's layer in expert groups on tensor cores (moe_prefill.HostTiles), as a prompt chunk that
spans steps runs it (chunk_advance.group_runner): each step plans and gathers the layer again, runs
the groups its budget allows and scatters their pairs' outputs into the chunk's kept buffer; the
other rows stay as they were. Against grouped_ffn_ref; under the simulator the products run on
HostBlas (numpy over the same addresses), on a GPU (MOEBUS_TEST_GPU=1) on cuBLAS."""
import numpy as np

from moebus.workers.moe_prefill import HostTiles
from tests.cuda.conftest import device
from tests.cuda.test_gemm import _experts, _reference, _routing, ops  # noqa: F401 - a fixture

SENTINEL = np.float32(7.0)


class FixedCache:
    """What HostTiles asks of an expert cache: each expert in a fixed arena slot; the odd ones
    reported as still being copied in (so both halves of gate|up run), ``wait`` counted."""

    def __init__(self, arena, slot_of):
        self.array, self.slot_of, self.waits, self.acquired = arena, slot_of, 0, []

    def acquire(self, layer, expert_ids):
        self.acquired.append(list(expert_ids))
        return self.slot_of[expert_ids], np.asarray(expert_ids) % 2 == 0

    def wait(self):
        self.waits += 1


def test_groups_run_in_separate_steps_write_only_their_pairs(ops, rng):
    hidden, inter, num_tokens, top_k = 16, 8, 40, 3
    arena, weights = _experts(rng, hidden, inter, 6)
    x = rng.standard_normal((num_tokens, hidden), dtype=np.float32)
    ids = _routing(rng, num_tokens, top_k, 6)
    slot_of = np.array([3, 0, 5, 1, 2, 4], np.int32)  # expert -> arena slot
    want = _reference(x, ids, weights, slot_of)
    cache = FixedCache(device(arena), slot_of)
    h = device(x)
    out = device(np.full((ids.size, hidden), SENTINEL, np.float32))  # the chunk's kept pair outputs
    unique = np.unique(ids)
    group_of_pair = np.searchsorted(unique, ids.ravel())
    done = np.zeros(ids.size, bool)
    for first, end in ((0, 2), (2, 3), (3, len(unique))):  # a step each: the plan and gather made again
        ops.begin_step()
        tiles = HostTiles(ops, cache, h, ids, hidden, inter)
        assert np.array_equal(tiles.plan.experts, unique)
        tiles.run_group(0, first, end)
        pairs = np.flatnonzero((group_of_pair >= first) & (group_of_pair < end))
        tiles.write_pairs(out, pairs)
        done[pairs] = True
        got = ops.to_host(out)
        np.testing.assert_allclose(got[done], want[done], rtol=1e-4, atol=1e-4)
        assert np.all(got[~done] == SENTINEL)
    assert done.all()
    assert cache.acquired == [list(unique[:2]), list(unique[2:3]), list(unique[3:])]
    groups = ((0, 2), (2, 3), (3, len(unique)))
    assert cache.waits == sum(bool(np.any(unique[a:b] % 2)) for a, b in groups)  # a miss: its tiles after the wait


def test_no_pairs_write_nothing(ops, rng):
    hidden, inter = 16, 8
    arena, _ = _experts(rng, hidden, inter, 6)
    ids = _routing(rng, 8, 3, 6)
    tiles = HostTiles(ops, FixedCache(device(arena), np.arange(6, dtype=np.int32)),
                      device(rng.standard_normal((8, hidden), dtype=np.float32)), ids, hidden, inter)
    out = device(np.full((ids.size, hidden), SENTINEL, np.float32))
    tiles.write_pairs(out, np.array([], np.int64))
    assert np.all(ops.to_host(out) == SENTINEL)


def test_warm_products_runs_both_products_at_every_tile_width_and_count(ops):
    """moe_prefill.warm_products (a worker's start): gate|up and down at each tile width tile_pairs can
    give and each batch count 1 ... max_tiles, as ExpertTiles._products calls them (so cuBLAS loads
    every kernel a spanning chunk's groups may pick before the first image)."""
    from moebus.cuda.kernels.gemm import OP_N, OP_T
    from moebus.cuda.kernels.grouped_moe import MIN_TILE_PAIRS, PAIRS_PER_TILE, tile_pairs
    from moebus.workers.moe_prefill import warm_products

    hidden, inter, calls = 16, 8, []
    blas = ops.tensor_cores.blas
    real = blas.gemm_batched

    def recorded(stream, trans_a, trans_b, m, n, k, *args, batch=1, **kw):
        calls.append((trans_a, trans_b, m, n, k, batch))
        return real(stream, trans_a, trans_b, m, n, k, *args, batch=batch, **kw)
    blas.gemm_batched = recorded
    assert warm_products(ops, hidden, inter, max_tiles=3) == len(calls)
    parts = ops.tensor_cores.parts
    widths = {tile_pairs(p, 1) for p in (1, 24, 40, 10_000)}
    assert widths == {t for t in (16, 32, 64) if MIN_TILE_PAIRS <= t <= PAIRS_PER_TILE}
    assert sorted(calls) == sorted((OP_T, OP_N, m, parts * t, k, count) for t in widths for count in (1, 2, 3)
                                   for m, k in ((2 * inter, hidden), (hidden, inter)))
    assert warm_products(ops, hidden, inter, max_tiles=0) == 0


def test_warm_dense_runs_each_weight_shape_at_every_row_count(ops):
    """moe_prefill.warm_dense (a worker's start): each distinct bf16 matrix shape once, at every row
    count from the tensor cores' least (or ``least_rows``) to ``max_rows``, each split part's product
    as TensorCores.matmul_nt calls it (beta 0, then 1), so that cuBLAS loads the kernel it picks for
    each n before the first image's chunk; other weights (norms, float32) are left out."""
    from moebus.cuda.kernels.gemm import OP_N, OP_T
    from moebus.workers.moe_prefill import warm_dense

    calls, blas = [], ops.tensor_cores.blas
    real = blas.gemm

    def recorded(stream, trans_a, trans_b, m, n, k, *args, beta=0.0, **kw):
        calls.append((trans_a, trans_b, m, n, k, beta))
        return real(stream, trans_a, trans_b, m, n, k, *args, beta=beta, **kw)
    blas.gemm = recorded
    bf16 = lambda rows, cols: device(np.zeros((rows, cols), np.uint16))  # noqa: E731
    weights = [bf16(24, 16), bf16(16, 8), bf16(24, 16), device(np.ones(16, np.uint16)), device(np.ones((4, 16), np.float32))]
    least = ops.tensor_cores.min_rows
    assert warm_dense(ops, weights, 0, least + 2) == len(calls)
    parts = ops.tensor_cores.parts
    assert sorted(calls) == sorted((OP_T, OP_N, m, n, k, float(part > 0)) for m, k in ((24, 16), (16, 8))
                                   for n in range(least, least + 3) for part in range(parts))
    calls.clear()
    assert warm_dense(ops, weights, least + 2, least + 2) == len(calls) == 2 * parts  # from least_rows on
    assert warm_dense(ops, weights, 0, least - 1) == 0 and warm_dense(ops, weights, 0, 0) == 0
