"""Routing on the device: the router's choices through the placement table into pair tables, and
the expert kernels reading resident experts from the arena and the rest from the host store."""
import numpy as np

from moebus.cuda.kernels.moe import expert_ffn_ref
from moebus.cuda.kernels.moe_ffn import expert_ffn_cuda
from moebus.cuda.kernels.routing import host_placement, route_pairs_cuda, route_pairs_ref
from tests.cuda.conftest import device, poisoned, stored

HIDDEN, INTER, EXPERTS = 16, 8, 6


def test_route_pairs_sorts_by_expert_and_follows_the_table(rng):
    ids = np.array([[3, 1], [1, 5], [0, 3]], np.int32)
    table = rng.integers(-20, 20, size=(2, EXPERTS)).astype(np.int32)
    outs = [poisoned((6,), np.int32) for _ in range(3)]
    route_pairs_cuda(device(ids), device(table), 1, *outs)
    token, slot, pair = (o.copy_to_host() for o in outs)
    assert pair.tolist() == [4, 1, 2, 0, 5, 3]  # experts 0, 1, 1, 3, 3, 5; ties in pair order
    assert token.tolist() == (pair // 2).tolist()
    assert slot.tolist() == table[1][ids.reshape(-1)[pair]].tolist()
    for got, want in zip((token, slot, pair), route_pairs_ref(ids, table, 1)):
        np.testing.assert_array_equal(got, want)


def test_experts_read_from_the_arena_or_the_host_store_give_the_same_result(rng):
    store = stored(rng.standard_normal((EXPERTS, 3 * INTER * HIDDEN), dtype=np.float32) * 0.3, "bf16")
    arena = np.zeros((3, store.shape[1]), store.dtype)
    arena[0], arena[2] = store[4], store[1]  # experts 4 and 1 resident, the rest read in place
    table = np.array([[host_placement(e) for e in range(EXPERTS)]], np.int32)
    table[0, 4], table[0, 1] = 0, 2
    x = rng.standard_normal((3, HIDDEN), dtype=np.float32)
    ids = np.array([[4, 1], [1, 0], [5, 4]], np.int32)
    tables = route_pairs_ref(ids, table, 0)
    out = poisoned((6, HIDDEN))
    expert_ffn_cuda(device(x), *(device(t) for t in tables), device(arena), HIDDEN, INTER, out,
                    poisoned((6, INTER)), store=device(store))
    everything_resident = np.zeros((6, HIDDEN), np.float32)
    flat = ids.reshape(-1)
    expert_ffn_ref(x, np.arange(6) // 2, flat, np.arange(6), store, HIDDEN, INTER, everything_resident)
    np.testing.assert_allclose(out.copy_to_host(), everything_resident, rtol=1e-5, atol=1e-6)
