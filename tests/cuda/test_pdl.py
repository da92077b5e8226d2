"""Programmatic dependent launch (kernels/pdl.py): which edges of a captured graph become programmatic
(pure Python), that every kernel of the decode step waits before anything else, and on a GPU that a
decode step replayed from a graph with programmatic edges gives the bits of the eager step."""
import ast
from pathlib import Path

import numpy as np
import pytest

from moebus.cuda.kernels import pdl

KERNELS = Path(__file__).resolve().parents[2] / "moebus" / "cuda" / "kernels"
DECODE_FILES = ("linear", "linear_quant", "moe", "moe_ffn", "moe_quant", "moe_quant_bf16", "norm_route", "routing",
                "attention_decode", "attention", "fused", "rmsnorm", "rope", "elementwise", "embedding", "sampling",
                "top_logprobs", "penalties", "gemm", "grouped_moe", "weighted_rows", "scatter", "prefetch",
                "split_epilogues", "qkv_gemv")


def test_mode_reads_the_port_from_the_environment(monkeypatch):
    for value, want in [("0", None), ("", None), ("1", "programmatic"), ("programmatic", "programmatic"),
                        ("launch_order", "launch_order")]:
        monkeypatch.setenv(pdl.ENV, value)
        assert pdl.mode() == want
    monkeypatch.setenv(pdl.ENV, "sideways")
    with pytest.raises(ValueError):
        pdl.mode()


def test_only_kernel_to_kernel_edges_into_waiting_kernels_are_converted():
    # nodes: 1, 2, 3 kernels that wait (functions 10, 11); 4 a kernel that does not (cuBLAS, 20);
    # 5 a memcpy (no function); 6 and 7 wait; 7 joins two branches
    functions = {1: 10, 2: 11, 3: 10, 4: 20, 6: 11, 7: 10}
    edges = [(1, 2), (2, 3), (3, 4), (4, 6), (5, 1), (2, 5), (8, 7), (6, 7), (4, 9)]
    assert pdl.plan_edges(edges, functions, {10, 11}) == [0, 1, 3]
    assert pdl.plan_edges(edges, functions, set()) == []


def test_a_graph_with_alloc_or_free_nodes_keeps_its_plain_edges():
    """cuGraphRemoveDependencies refuses graphs with memory alloc / free nodes (batch 8's graph in the
    thirteenth session's first call, cuBLAS's workspace): make_programmatic then converts nothing."""
    assert pdl.refusal({"CU_GRAPH_NODE_TYPE_MEMSET": 49, "CU_GRAPH_NODE_TYPE_MEMCPY": 1}) is None
    assert pdl.refusal({}) is None
    assert pdl.refusal({"CU_GRAPH_NODE_TYPE_MEM_ALLOC": 0}) is None
    reason = pdl.refusal({"CU_GRAPH_NODE_TYPE_MEM_ALLOC": 2, "CU_GRAPH_NODE_TYPE_MEM_FREE": 1,
                          "CU_GRAPH_NODE_TYPE_MEMSET": 3})
    assert reason == "graph has 2 mem alloc nodes, 1 mem free nodes"


def test_the_trigger_is_read_from_the_environment_and_keys_the_kernel_cache(monkeypatch):
    """MOEBUS_PDL_TRIGGER changes the compiled wait (wait + launch_dependents), so kernels compiled with
    it live under another kernel-cache fingerprint than kernels compiled without it; unset is on."""
    from moebus.cuda.kernels import kernel_cache

    monkeypatch.delenv(pdl.TRIGGER_ENV, raising=False)
    default = kernel_cache.source_fingerprint()
    assert pdl.trigger_after_wait()
    monkeypatch.setenv(pdl.TRIGGER_ENV, "1")
    assert pdl.trigger_after_wait() and kernel_cache.source_fingerprint() == default
    monkeypatch.setenv(pdl.TRIGGER_ENV, "0")
    assert not pdl.trigger_after_wait() and kernel_cache.source_fingerprint() != default
    assert pdl.TRIGGER_ENV in kernel_cache.COMPILE_ENV


def test_kernels_that_call_the_wait_are_recognised():
    def waiting():
        pdl.grid_dependency_wait()

    def plain():
        return 1

    def calls_by_name():
        grid_dependency_wait()  # noqa: F821 - only its name is read

    assert pdl.waits(waiting) and pdl.waits(calls_by_name) and not pdl.waits(plain)


# kernels that read before they wait, and why that is safe: moe_ffn's down GEMV reads its pair's slot
# (the routing's, two kernels back) with PREFETCH_DOWN_BEFORE_WAIT, only where pdl.released_early();
# norm_route's in-flight kernel reads its router rows and norm weights (weights) with ROUTER_EARLY, its route_tail
# the norm weights
EARLY_READERS = {"expert_down", "inflight_route_rows", "route_tail"}


def _is_wait(statement) -> bool:
    return isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call) and \
        getattr(statement.value.func, "id", None) == pdl.WAIT_NAME


@pytest.mark.parametrize("name", DECODE_FILES)
def test_every_kernel_of_the_decode_step_waits_first(name):
    """A kernel behind a programmatic edge must wait before any global read or write, in every block:
    the wait is a statement of the kernel's own body, and what comes before it indexes no array
    (arithmetic on thread and block ids and shapes; linear.py's weight prefetch)."""
    tree = ast.parse((KERNELS / f"{name}.py").read_text())
    kernels = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
               and any(isinstance(d, ast.Name) and d.id == "kernel" for d in node.decorator_list)]
    assert kernels
    for node in kernels:
        waits = [i for i, statement in enumerate(node.body) if _is_wait(statement)]
        assert waits, f"{name}.{node.name} does not wait"
        before = node.body[:waits[0]]
        if node.name in EARLY_READERS:
            continue
        assert not any(isinstance(n, (ast.Subscript, ast.Return)) for s in before for n in ast.walk(s)), \
            f"{name}.{node.name} reads, writes or returns before it waits"


def test_the_wait_is_a_no_op_in_the_simulator():
    from moebus.cuda.kernels.compat import SIMULATOR, cuda

    if not SIMULATOR:
        pytest.skip("simulator only")
    from moebus.cuda.kernels.elementwise import add_flat

    x, y, out = np.arange(8, dtype=np.float32), np.ones(8, np.float32), np.zeros(8, np.float32)
    add_flat[1, 32](x, y, out)
    np.testing.assert_array_equal(out, x + 1)


@pytest.mark.parametrize("port", pdl.PORTS)
def test_a_graph_with_programmatic_edges_gives_the_bits_of_the_eager_step(port, monkeypatch, tmp_path):
    """The micro model's decode (norm_route's last-block counter, the attention split kernel's merge,
    the expert GEMVs, sampling) replayed from graphs whose kernel edges are programmatic, against the
    same steps run eagerly."""
    from moebus.cuda.backends.graphs import graphs_available

    if not graphs_available():
        pytest.skip("CUDA graphs need a GPU")
    from moebus.common import tiny_model
    from tests.cuda.test_e2e import MICRO
    from tests.cuda.test_launch_ahead import prefill_step, steps_one_at_a_time

    monkeypatch.setitem(tiny_model.PRESETS, "micro", MICRO)
    monkeypatch.setitem(tiny_model.PRESET_SHARDED, "micro", False)
    model_dir = tiny_model.init_model(tmp_path, "qwen3_moe", "micro")
    converted, make = [], pdl.make_programmatic
    monkeypatch.setattr(pdl, "make_programmatic", lambda graph, p: converted.append(make(graph, p)) or converted[-1])
    for rows in (1, 2):
        monkeypatch.setenv("MOEBUS_CUDA_GRAPHS", "0")
        want = steps_one_at_a_time(model_dir, prefill_step(rows), rows)
        monkeypatch.setenv("MOEBUS_CUDA_GRAPHS", "1")
        monkeypatch.setenv(pdl.ENV, port)
        got = steps_one_at_a_time(model_dir, prefill_step(rows), rows)
        monkeypatch.setenv(pdl.ENV, "0")
        assert [g.tokens.tolist() for g in got] == [w.tokens.tolist() for w in want]
        np.testing.assert_array_equal(np.array([g.logprobs for g in got]), np.array([w.logprobs for w in want]))
    assert converted and all(c["converted"] > 0 and "refused" not in c for c in converted), converted
    assert not any("MEM_ALLOC" in kind for c in converted for kind in c["types"]), converted  # gemm_host's workspace


@pytest.mark.parametrize("port", ["programmatic", "launch_order", "0"])
def test_the_down_prefetch_before_the_wait_gives_the_same_bits(port, monkeypatch, rng):
    """moe_ffn.PREFETCH_DOWN_BEFORE_WAIT (gate|up releasing the down GEMV, which prefetches before
    its wait where the port allows it) changes no result."""
    from moebus.cuda.dtypes import f32_to_bf16
    from moebus.cuda.kernels import compat, moe_ffn

    hidden, inter, slots = 64, 32, 4
    arena = f32_to_bf16(rng.standard_normal((slots, 3 * hidden * inter)).astype(np.float32) * 0.1)
    x = rng.standard_normal((2, hidden)).astype(np.float32)
    pair_token = np.array([0, 0, 1, 1], np.int32)
    pair_slot = np.array([1, 3, 0, 3], np.int32)
    pair_out = np.arange(4, dtype=np.int32)
    monkeypatch.setenv(pdl.ENV, port)
    results = []
    for early in (False, True):
        monkeypatch.setattr(moe_ffn, "PREFETCH_DOWN_BEFORE_WAIT", early)
        args = [compat.cuda.to_device(a) for a in (x, pair_token, pair_slot, pair_out, arena)]
        out = compat.cuda.to_device(np.zeros((4, hidden), np.float32))
        scratch = compat.cuda.to_device(np.zeros((4, inter), np.float32))
        results.append(moe_ffn.expert_ffn_cuda(*args, hidden, inter, out, scratch).copy_to_host())
    np.testing.assert_array_equal(results[0], results[1])
