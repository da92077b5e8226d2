"""Routing on the device: the router's choices through the placement table into pair tables, and
the expert kernels reading resident experts from the arena and the rest from the host store."""
import numpy as np
import pytest

from moebus.cuda.kernels.moe import expert_ffn_ref
from moebus.cuda.kernels.moe_ffn import expert_ffn_cuda
from moebus.cuda.kernels.routing import host_placement, route_pairs_cuda, route_pairs_ref
from tests.cuda.conftest import device, poisoned, stored

HIDDEN, INTER, EXPERTS = 16, 8, 6
PAIR_NAMES = ("total", "h", "ids", "weights", "pair_token", "pair_slot", "pair_out")  # norm_route's outputs


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


def _norm_route(x, y, norm_weight, router, top_k, normalize, table, row, done, scratch=None):
    from moebus.cuda.kernels.norm_route import norm_route_cuda

    num_tokens, dim = x.shape
    outs = [poisoned((num_tokens, dim)), poisoned((num_tokens, dim)), poisoned((num_tokens, top_k), np.int32),
            poisoned((num_tokens, top_k))] + [poisoned((num_tokens * top_k,), np.int32) for _ in range(3)]
    norm_route_cuda(device(x), device(y), device(norm_weight), 1e-6, device(router), top_k, normalize, device(table),
                    row, done, *outs, scratch=scratch)
    return [o.copy_to_host() for o in outs]


@pytest.mark.parametrize("in_flight", [True, False])
@pytest.mark.parametrize("dim", [40, 13, 400])
def test_norm_route_matches_the_unfused_ops(rng, dim, in_flight, monkeypatch):
    # add + rmsnorm, router, top-k + softmax and the pair tables in one launch; three times with one
    # counter (the last block resets it, as a replayed graph needs), 1 and 3 tokens; wide and narrow
    # reads; 400 wide: the in-flight kernel's threads hold 2 words and take its 37 experts in 3 rounds
    from moebus.cuda.kernels import norm_route
    from moebus.cuda.kernels.norm_route import norm_route_ref

    monkeypatch.setattr(norm_route, "ROUTER_IN_FLIGHT", in_flight)  # the router's rows in flight first, or not
    experts, top_k = 37, 3  # 37 experts: two registers per lane, the second one partly padding
    norm_weight = stored(rng.standard_normal(dim, dtype=np.float32), "bf16")
    router = stored(rng.standard_normal((experts, dim), dtype=np.float32), "bf16")
    table = rng.integers(-30, 30, size=(2, experts)).astype(np.int32)
    done = device(np.zeros(1, np.int32))
    for num_tokens, normalize in ((3, True), (1, False), (3, False)):
        x, y = (rng.standard_normal((num_tokens, dim), dtype=np.float32) for _ in range(2))
        got = _norm_route(x, y, norm_weight, router, top_k, normalize, table, 1, done)
        want = norm_route_ref(x, y, norm_weight, 1e-6, router, top_k, normalize, table, 1)
        for name, g, w in zip(PAIR_NAMES, got, want):
            if g.dtype == np.int32:
                np.testing.assert_array_equal(g, w, err_msg=name)
            else:
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=name)
        assert done.copy_to_host()[0] == 0


@pytest.mark.parametrize("experts, top_k, tied, num_tokens, spread", [  # ties: 1 token (3 in the simulator: ~50 s)
    (32, 8, False, 1, False), (32, 8, False, 1, True), (32, 8, False, 3, True), (12, 4, True, 1, False),
    (12, 4, True, 1, True)])
def test_norm_route_by_ranks_gives_the_bits_of_argmaxes_in_turn(rng, experts, top_k, tied, num_tokens, spread,
                                                                monkeypatch):
    # <= 32 experts: top-k and pairs by ranks (ranks_tail, or one_token_tail for one token) or by
    # topk_row + sort_pairs, bit for bit, both normalisations: one token in one block, or 1 and 3
    # tokens with the router spread over blocks (a scratch); a router of zeros ties every expert (the
    # lower ids win, every token the same)
    from moebus.cuda.kernels import norm_route
    from moebus.cuda.kernels.norm_route import norm_route_ref

    dim = 40
    norm_weight = stored(rng.standard_normal(dim, dtype=np.float32), "bf16")
    router = stored(rng.standard_normal((experts, dim), dtype=np.float32) * (0 if tied else 1), "bf16")
    table = rng.integers(-30, 30, size=(1, experts)).astype(np.int32)
    x, y = (rng.standard_normal((num_tokens, dim), dtype=np.float32) for _ in range(2))
    for normalize in (True, False):
        runs = []
        for by_ranks, one_token in ((True, True), (True, False), (False, True)):  # the last: argmaxes in turn
            monkeypatch.setattr(norm_route, "ROUTER_RANKS", by_ranks)
            monkeypatch.setattr(norm_route, "ONE_TOKEN_TAIL", one_token)
            scratch = poisoned((num_tokens, experts)) if spread else None
            runs.append(_norm_route(x, y, norm_weight, router, top_k, normalize, table, 0,
                                    device(np.zeros(1, np.int32)), scratch))
        want = norm_route_ref(x, y, norm_weight, 1e-6, router, top_k, normalize, table, 0)
        for name, one_token, ranked, in_turn, w in zip(PAIR_NAMES, *runs, want):
            np.testing.assert_array_equal(one_token, in_turn, err_msg=name)
            np.testing.assert_array_equal(ranked, in_turn, err_msg=name)
            np.testing.assert_allclose(ranked, w, rtol=1e-5, atol=1e-6, err_msg=name)
        if tied:
            assert runs[0][2].tolist() == [list(range(top_k))] * num_tokens


@pytest.mark.parametrize("experts, top_k, dim", [(32, 8, 40), (37, 3, 400)])
def test_norm_route_spread_over_blocks_gives_the_bits_of_one_block_a_token(rng, experts, top_k, dim, monkeypatch):
    # the router's rows over several blocks a token (logits through a scratch, the grid's last block
    # finishes) or one block a token: the same bits, 1 and 3 tokens, ranks (32 experts) and argmaxes;
    # one counter for every launch (each launch's last block resets it)
    from moebus.cuda.kernels import norm_route
    from moebus.cuda.kernels.norm_route import norm_route_ref

    norm_weight = stored(rng.standard_normal(dim, dtype=np.float32), "bf16")
    router = stored(rng.standard_normal((experts, dim), dtype=np.float32), "bf16")
    table = rng.integers(-30, 30, size=(2, experts)).astype(np.int32)
    done = device(np.zeros(1, np.int32))
    for num_tokens, normalize in ((1, True), (3, False)):
        x, y = (rng.standard_normal((num_tokens, dim), dtype=np.float32) for _ in range(2))
        runs = []
        for blocks in (1, 3, 8):  # 8: 37 experts as 7 blocks of 5 and one of 2
            monkeypatch.setattr(norm_route, "ROUTER_BLOCKS", blocks)
            scratch = poisoned((num_tokens, experts))
            runs.append(_norm_route(x, y, norm_weight, router, top_k, normalize, table, 1, done, scratch))
            assert done.copy_to_host()[0] == 0
            if blocks > 1:  # the spread kernel ran: the scratch holds every logit
                assert not np.isnan(scratch.copy_to_host()).any()
        want = norm_route_ref(x, y, norm_weight, 1e-6, router, top_k, normalize, table, 1)
        for name, one, three, eight, w in zip(PAIR_NAMES, *runs, want):
            np.testing.assert_array_equal(three, one, err_msg=name)
            np.testing.assert_array_equal(eight, one, err_msg=name)
            np.testing.assert_allclose(one, w, rtol=1e-5, atol=1e-6, err_msg=name)


def _switch_gives_the_same_bits(rng, monkeypatch, switch, experts, top_k, dim, cases):
    """norm_route with ``switch`` off and on over ``cases`` of (tokens, blocks, tied router, normalize): the
    same bits in every output; one counter, back at 0 after each run. Returns the last case's runs."""
    from moebus.cuda.kernels import norm_route

    norm_weight = stored(rng.standard_normal(dim, dtype=np.float32), "bf16")
    table = rng.integers(-30, 30, size=(2, experts)).astype(np.int32)
    done = device(np.zeros(1, np.int32))
    for num_tokens, blocks, tied, normalize in cases:
        router = stored(rng.standard_normal((experts, dim), dtype=np.float32) * (0 if tied else 1), "bf16")
        x, y = (rng.standard_normal((num_tokens, dim), dtype=np.float32) for _ in range(2))
        monkeypatch.setattr(norm_route, "ROUTER_BLOCKS", blocks)
        runs = []
        for on in (False, True):
            monkeypatch.setattr(norm_route, switch, on)
            runs.append(_norm_route(x, y, norm_weight, router, top_k, normalize, table, 1, done,
                                    poisoned((num_tokens, experts))))
            assert done.copy_to_host()[0] == 0
        for name, off, on in zip(PAIR_NAMES, *runs):
            np.testing.assert_array_equal(on, off, err_msg=f"{switch} {name} ({num_tokens} tokens, {blocks} blocks)")
        if tied:  # a router of zeros: the first top_k experts, in order
            assert runs[-1][2].tolist() == [list(range(top_k))] * num_tokens


@pytest.mark.parametrize("experts, top_k, dim", [(32, 8, 40), (37, 3, 400)])
def test_norm_route_router_prefetch_gives_the_same_bits(rng, experts, top_k, dim, monkeypatch):
    # ROUTER_PREFETCH: the block's router rows asked of L2 before the wait (rows past the last expert
    # clamped to it: 37 experts over 8 blocks of 5), one block a token or spread, 1 and 3 tokens
    _switch_gives_the_same_bits(rng, monkeypatch, "ROUTER_PREFETCH", experts, top_k, dim,
                                ((1, 8, False, True), (3, 1, False, True)))


@pytest.mark.parametrize("experts, top_k, dim", [(32, 8, 40), (32, 8, 400), (37, 3, 400)])
def test_norm_route_early_loads_give_the_same_bits(rng, experts, top_k, dim, monkeypatch):
    # ROUTER_EARLY (round 0's router words and the norm's weights before the wait): one block a token or
    # spread over 8, 1 and 3 tokens, ties (a router of zeros) and both normalisations
    _switch_gives_the_same_bits(rng, monkeypatch, "ROUTER_EARLY", experts, top_k, dim,
                                ((1, 8, False, True), (1, 8, True, False), (3, 8, False, True), (1, 1, False, False)))


def test_norm_route_router_share(monkeypatch):
    # experts a block: a token's router rows over ROUTER_BLOCKS blocks, given a scratch and few tokens
    from moebus.cuda.kernels import norm_route
    from moebus.cuda.kernels.norm_route import SPREAD_EXPERTS, SPREAD_TOKENS, router_share

    monkeypatch.setattr(norm_route, "ROUTER_BLOCKS", 8)
    assert router_share(1, 32, True) == 4 and router_share(8, 32, True) == 4
    assert router_share(1, 37, True) == 5  # 8 blocks: 7 of 5 experts and one of 2
    assert router_share(1, 4, True) == 1  # no more blocks than experts
    assert router_share(1, 32, False) == 32  # no scratch: one block a token
    assert router_share(SPREAD_TOKENS + 1, 32, True) == 32
    assert router_share(1, SPREAD_EXPERTS + 1, True) == SPREAD_EXPERTS + 1


def test_norm_route_in_flight_shapes():
    # 2048 wide (A3B) over 512 threads: a word a thread, 32 experts in one round; 64 experts two
    from moebus.cuda.kernels.norm_route import inflight_shape

    assert inflight_shape(2048, 32, 512) == (1, 1, 32, 1)
    assert inflight_shape(2048, 128, 512) == (1, 4, 32, 1)
    assert inflight_shape(40, 37, 64) == (1, 1, 19, 2)  # 10 words: two groups of a warp
    assert inflight_shape(400, 37, 64) == (2, 3, 16, 1)
    assert inflight_shape(4 * 64 * 33, 8, 64) is None  # 33 words a thread: more than a round holds


def test_norm_route_rejects_too_many_pairs():
    from moebus.cuda.kernels.norm_route import MAX_PAIRS

    x = np.zeros((MAX_PAIRS // 2 + 1, 8), np.float32)
    with pytest.raises(ValueError, match="pairs"):
        _norm_route(x, x, np.ones(8, np.float32), np.ones((4, 8), np.float32), 2, True, np.zeros((1, 4), np.int32),
                    0, device(np.zeros(1, np.int32)))
