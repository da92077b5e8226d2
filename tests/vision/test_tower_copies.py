"""The towers' host copies in slices at once (workers/tower_graph.copy_pairs): what lands equals a
plain numpy copy, whatever the slicing; Qwen3-VL's outputs collected into embeds and stacked
DeepStack features."""
import numpy as np
import pytest

from moebus.workers import tower_graph
from moebus.workers.tower_outputs import embeds_and_deepstack, views_of_one


@pytest.fixture
def rng():
    return np.random.default_rng(18)


@pytest.fixture
def sliced(monkeypatch):
    monkeypatch.setattr(tower_graph, "COPY_THREADS", 3)
    monkeypatch.setattr(tower_graph, "COPY_SLICE_BYTES", 40)  # 10 floats: slices end mid-row


def test_copies_in_slices_equal_plain_ones(rng, sliced):
    big, small = rng.standard_normal((37, 11), dtype=np.float32), np.arange(3, dtype=np.int32)
    dst_big, dst_small = np.zeros_like(big), np.zeros_like(small)
    tower_graph.copy_pairs([(dst_big, big), (dst_small, small)])
    np.testing.assert_array_equal(dst_big, big)
    np.testing.assert_array_equal(dst_small, small)
    strided = big[:, ::2]  # not contiguous: one plain copy
    np.testing.assert_array_equal(tower_graph.copied(strided), strided)
    as_float64 = np.zeros(big.shape, np.float64)  # another dtype: numpy converts, as before
    tower_graph.copy_pairs([(as_float64, big)])
    np.testing.assert_array_equal(as_float64, big.astype(np.float64))


def test_a_copy_of_another_shape_is_refused(sliced):
    with pytest.raises(ValueError, match=r"copy of \(4,\) into \(5,\)"):
        tower_graph.copy_pairs([(np.zeros(5, np.float32), np.ones(4, np.float32))])


def test_qwen3vl_outputs_come_out_as_embeds_and_stacked_deepstack(rng, sliced):
    out = {"embeds": rng.standard_normal((6, 8), dtype=np.float32)}
    out.update({f"deepstack{j}": rng.standard_normal((6, 8), dtype=np.float32) for j in range(3)})
    embeds, deepstack = embeds_and_deepstack(out)
    np.testing.assert_array_equal(embeds, out["embeds"])
    np.testing.assert_array_equal(deepstack, np.stack([out[f"deepstack{j}"] for j in range(3)]))
    assert not np.shares_memory(embeds, out["embeds"]) and not np.shares_memory(deepstack, out["deepstack0"])
    assert views_of_one(embeds, deepstack)  # one fresh (1 + L, N, D) array: what ENCODE_REPLY carries
    none = embeds_and_deepstack({"embeds": out["embeds"]})[1]
    assert none.shape == (0, 6, 8) and none.dtype == np.float32


def test_outputs_read_as_the_graph_makes_them_are_stacked_the_same(rng, sliced):
    """The COLLECT_BESIDE path (ReadyOutputs): the embeddings' pages touched before the first wait,
    then each output copied once ready; the same stacked array as the plain path."""
    from types import SimpleNamespace

    from moebus.workers.tower_outputs import ReadyOutputs

    out = {"embeds": rng.standard_normal((6, 1030), dtype=np.float32)}
    out.update({f"deepstack{j}": rng.standard_normal((6, 1030), dtype=np.float32) for j in range(3)})
    waits = []
    stream = SimpleNamespace(synchronize=lambda: waits.append(1))
    graph = SimpleNamespace(host_outputs=out, flag_of={}, backend=SimpleNamespace(stream=stream))
    embeds, deepstack = embeds_and_deepstack(ReadyOutputs(graph))
    np.testing.assert_array_equal(embeds, out["embeds"])
    np.testing.assert_array_equal(deepstack, np.stack([out[f"deepstack{j}"] for j in range(3)]))
    assert waits == [1]  # no flags: the first read waits for the whole graph, once


def test_touch_pages_writes_one_element_a_page():
    from moebus.workers.tower_outputs import touch_pages

    array = np.full((3, 50), 7.0, np.float32)
    touch_pages(array, page_bytes=64)  # 16 floats a page
    flat = array.reshape(-1)
    assert (flat[::16] == 0).all() and (np.delete(flat, np.arange(0, flat.size, 16)) == 7).all()
