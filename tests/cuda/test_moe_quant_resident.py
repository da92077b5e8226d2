"""The down GEMV's early loads (moe_quant_round.DOWN_LOAD_BEFORE_WAIT) follow the expert cache's residency: the
decode step chooses them (Stage._run, choose_down_early) only where every expert is resident and none is lent,
a captured graph keeps its choice (Stage._graph_for recaptures a graph captured with them once they are no
longer allowed), and the tokens and log p are those of the step without them, bit for bit."""
from types import SimpleNamespace

import numpy as np
import pytest

from moebus.cuda.kernels import moe_quant_round
from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel
from tests.cuda.test_quant_e2e import micro_fp8_model  # noqa: F401 - the module's fixture

pytestmark = pytest.mark.usefixtures("exact_quant_kernels")  # the numba down kernel's early loads

PROMPT = [5, 17, 42, 9, 77]


def _down_choices(monkeypatch) -> list[bool]:
    """The ``early`` of every down kernel chosen from now on (moe_quant_round.kernels, released early)."""
    chosen, original = [], moe_quant_round.one_round_kernel
    monkeypatch.setattr(moe_quant_round, "released_early", lambda: True)

    def spy(cols, mats, rows, *args, **kwargs):
        kernel = original(cols, mats, rows, *args, **kwargs)
        if mats == 1:
            early = kwargs.get("early", args[5] if len(args) > 5 else False)
            chosen.append(early)
        return kernel

    monkeypatch.setattr(moe_quant_round, "one_round_kernel", spy)
    return chosen


def test_down_early_needs_the_switch_quantized_experts_every_expert_resident_and_no_loan(monkeypatch):
    def cache(layout="fp8", not_resident=0, loaned_from=None):
        return SimpleNamespace(store=SimpleNamespace(layout=layout), not_resident=not_resident, loaned_from=loaned_from)

    monkeypatch.setattr(moe_quant_round, "DOWN_LOAD_BEFORE_WAIT", False)
    assert not moe_quant_round.down_early_for(cache())
    monkeypatch.setattr(moe_quant_round, "DOWN_LOAD_BEFORE_WAIT", True)
    assert moe_quant_round.down_early_for(cache())
    assert not moe_quant_round.down_early_for(cache(layout=None))  # bf16 experts: moe_ffn.py's kernels
    assert not moe_quant_round.down_early_for(cache(not_resident=3))  # a partial cache: uploads may rewrite slots
    assert not moe_quant_round.down_early_for(cache(loaned_from=6))  # slots lent to a prefill
    assert not moe_quant_round.down_early_for(None)  # not a routed decode step (Stage._run of a prefill)
    assert moe_quant_round.choose_down_early(cache()) and moe_quant_round._down_early
    assert not moe_quant_round.choose_down_early(cache(not_resident=1)) and not moe_quant_round._down_early


def test_the_decode_step_loads_down_early_only_when_all_resident_and_gives_the_same_bits(
        micro_fp8_model, monkeypatch, experts_dtype="fp8"):  # noqa: F811 - int4's micro rows (16 codes) are not whole words
    # a micro model's cache is one 2 MiB granule at any fraction (every expert resident): a partial cache is
    # told here by its not_resident, as ExpertCache counts it (the experts no slot holds)
    from moebus.workers.expert_cache import ExpertCache

    monkeypatch.setattr(moe_quant_round, "DOWN_LOAD_BEFORE_WAIT", True)
    chosen = _down_choices(monkeypatch)
    runs = {}
    for missing in (0, 3):
        with monkeypatch.context() as patch:
            if missing:
                patch.setattr(ExpertCache, "not_resident", property(lambda self: missing))
            model = LocalModel(micro_fp8_model, device="cuda", max_context=32, experts_dtype=experts_dtype,
                               attention_dtype="fp8")
            del chosen[:]
            runs[missing] = model.generate(PROMPT, 3)
        assert chosen and set(chosen) == {missing == 0}, (missing, chosen)
    monkeypatch.setattr(moe_quant_round, "DOWN_LOAD_BEFORE_WAIT", False)
    model = LocalModel(micro_fp8_model, device="cuda", max_context=32, experts_dtype=experts_dtype,
                       attention_dtype="fp8")
    del chosen[:]
    plain = model.generate(PROMPT, 3)
    assert chosen and not any(chosen)
    assert runs[0].tokens == plain.tokens
    np.testing.assert_array_equal(np.asarray(runs[0].logprobs, np.float32), np.asarray(plain.logprobs, np.float32))


def test_a_step_captured_with_early_loads_is_recaptured_when_they_are_no_longer_allowed(micro_fp8_model,  # noqa: F811
                                                                                        monkeypatch):
    # Stage._graph_for with a stand-in for CapturedStep (the simulator has no graphs): the choice is kept per
    # graph; a graph without the early loads stays when they become allowed (safe; no capture beside a step
    # launched ahead), one with them is captured again when they are not (a partial cache, here: the switch)
    from moebus.cuda.backends import graphs

    class Captured:
        def __init__(self, backend, host_inputs, run, pool=None):
            self.specs = {name: (a.shape, a.dtype) for name, a in host_inputs.items()}
            self.closed = False

        def matches(self, host_inputs):
            return self.specs == {name: (a.shape, a.dtype) for name, a in host_inputs.items()}

        def close(self):
            self.closed = True

    monkeypatch.setattr(graphs, "CapturedStep", Captured)
    monkeypatch.setattr(graphs, "shared_pool", lambda: object())
    model = LocalModel(micro_fp8_model, device="cuda", max_context=32, experts_dtype="fp8", attention_dtype="fp8")
    stage = model.stages[0]
    stage.use_graphs = True
    batch = StepBatch(slots=[0], starts=[4], lengths=[1], tokens=[7])
    inputs = stage._host_inputs(batch, None)
    monkeypatch.setattr(moe_quant_round, "DOWN_LOAD_BEFORE_WAIT", False)
    first = stage._graph_for(batch, inputs)
    assert stage._graph_for(batch, inputs) is first and stage.graph_captures == 1
    monkeypatch.setattr(moe_quant_round, "DOWN_LOAD_BEFORE_WAIT", True)  # allowed now: the graph without them stays
    assert stage._graph_for(batch, inputs) is first and stage.graph_captures == 1
    stage.graphs.clear()  # (a new shape, a recapture for another reason): captured with them
    second = stage._graph_for(batch, inputs)
    assert second is not first and list(stage.graph_down_early.values()) == [True]
    assert stage._graph_for(batch, inputs) is second and stage.graph_captures == 2
    from moebus.workers.expert_cache import ExpertCache

    monkeypatch.setattr(ExpertCache, "not_resident", property(lambda self: 2))  # a shrink or a loan: not allowed
    third = stage._graph_for(batch, inputs)
    assert third is not second and second.closed and stage.graph_captures == 3
    assert list(stage.graph_down_early.values()) == [False] and stage._graph_for(batch, inputs) is third


def test_captured_steps_with_the_early_loads_give_the_bits_of_those_without(micro_fp8_model,  # noqa: F811
                                                                            monkeypatch):
    # on a GPU: CUDA graphs (PDL released early where the driver has it); a graph captured with the early down
    # loads, then a cache that no longer holds every expert (told by not_resident): captured again without them;
    # the tokens and log p of both equal those of graphs captured with the switch off
    from moebus.cuda.backends.graphs import graphs_available
    from moebus.workers.expert_cache import ExpertCache

    if not graphs_available():
        pytest.skip("CUDA graphs need a GPU")
    chosen = _down_choices(monkeypatch)
    runs = {}
    for switch in (True, False):
        monkeypatch.setattr(moe_quant_round, "DOWN_LOAD_BEFORE_WAIT", switch)
        model = LocalModel(micro_fp8_model, device="cuda", max_context=32, experts_dtype="fp8", attention_dtype="fp8")
        stage, key = model.stages[0], (1, False)  # the decode step's graph (batch 1, no mask)
        first = model.generate(PROMPT, 4)
        graph, early = stage.graphs.get(key), stage.graph_down_early.get(key)
        with monkeypatch.context() as patch:
            patch.setattr(ExpertCache, "not_resident", property(lambda self: 1))
            second = model.generate(PROMPT, 4)
        runs[switch] = (first, second, (graph is not None, early, stage.graphs.get(key) is not graph,
                                        stage.graph_down_early.get(key)))
    (first, second, graphs), (want_first, want_second, _) = runs[True], runs[False]
    assert graphs == (True, True, True, False) and True in chosen  # captured with them, then again without
    for got, want in ((first, want_first), (second, want_second)):
        assert got.tokens == want.tokens
        np.testing.assert_array_equal(np.asarray(got.logprobs, np.float32), np.asarray(want.logprobs, np.float32))
