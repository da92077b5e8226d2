"""A prompt's chunk that spans steps (workers/spanning_chunk.py): beside a decode row, with a cache of
a few slots and a budget of one expert's bytes a step, the chunk takes many steps; its sampled
token, logprob, logits and the keys and values it wrote equal those of the chunk run whole in one
step, bit for bit, and the decode row's equal those of its step run alone."""
import numpy as np
import pytest

from moebus.workers import chunk_advance
from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel

CHUNK = list(range(3, 83))  # 80 tokens: more than a routed step's 64, so the step would copy experts


def _model(model_dir, budget_blobs: float | None) -> LocalModel:
    model = LocalModel(model_dir, device="cpu", cache_fraction=0.3)
    stage = model.stages[0]
    assert stage.experts.num_slots < 0.5 * 8 * 4  # of 8 experts x 4 layers: really a few slots
    if budget_blobs is not None:
        stage.chunk_copy_budget_bytes = int(budget_blobs * stage.experts.store.blob_bytes)
    return model


def _decode_ready(model) -> None:
    """Slot 0 holds a short prompt, so that its next token can decode beside the chunk."""
    model.step(StepBatch(slots=[0], starts=[0], lengths=[3], tokens=[11, 12, 13]))


IMAGE_ROWS = np.array([5, 6, 7, 40], np.int32)  # rows of the chunk whose embedding an image's replaces
IMAGE = np.random.default_rng(1).standard_normal((len(IMAGE_ROWS), 64)).astype(np.float32)


def _mixed(position: int, chunk=CHUNK, start: int = 0, image: bool = False) -> StepBatch:
    images = {"embeds": IMAGE, "embed_rows": IMAGE_ROWS + 1} if image else {}  # after the decode row's token
    return StepBatch(slots=[0, 1], starts=[position, start], lengths=[1, len(chunk)], tokens=[21] + chunk,
                     top_logprobs=2, **images)


def _small_scratch(model) -> None:
    """A standing scratch of 4 tokens: the chunk borrows from the cache and runs in pieces."""
    from moebus.workers.cache_sizing import ScratchBudget

    model.stages[0].scratch = ScratchBudget(model.stages[0].cfg, tokens=4)


def _kv(model, slot: int, upto: int):
    kv = model.stages[0].kv
    return [np.array(k[slot, :, :upto]) for k in kv.k] + [np.array(v[slot, :, :upto]) for v in kv.v]


@pytest.mark.parametrize("case", ["plain", "image rows", "in pieces"])
def test_a_chunk_run_in_many_steps_equals_it_run_whole(model_dirs, case):
    """``image rows``: some of the chunk's embeddings replaced (a LLaVA prompt); ``in pieces``: a
    prompt loan shorter than the chunk, which then runs in pieces, whole or spanning steps."""
    image = case == "image rows"
    whole = _model(model_dirs["init_qwen3"], None)
    _decode_ready(whole)
    if case == "in pieces":
        _small_scratch(whole)
    images = {"embeds": IMAGE, "embed_rows": IMAGE_ROWS} if image else {}
    want_chunk = whole.step(StepBatch(slots=[1], starts=[0], lengths=[80], tokens=CHUNK, top_logprobs=2, **images),
                            want_logits=True)
    want_decode = whole.step(StepBatch(slots=[0], starts=[3], lengths=[1], tokens=[21], top_logprobs=2),
                             want_logits=True)

    sliced = _model(model_dirs["init_qwen3"], 1.0)
    _decode_ready(sliced)
    if case == "in pieces":
        _small_scratch(sliced)
    stage = sliced.stages[0]
    misses_before = stage.experts.misses
    steps, position = 0, 3
    while True:
        out = sliced.step(_mixed(position, image=image), want_logits=True)
        if steps == 0 and case == "in pieces":
            assert len(stage.chunk.pieces) > 1
        steps += 1
        # the decode row samples in every step, exactly as its step alone would (it is run alone)
        if steps == 1:
            assert out.tokens[0] == want_decode.tokens[0]
            assert np.array_equal(out.logits[0], want_decode.logits[0])
        if out.pending_rows is None:
            break
        assert list(out.pending_rows) == [1] and stage.chunk is not None
        assert steps < 400
    assert steps > 3  # a budget of one expert: many steps
    assert stage.chunk is None and stage.chunks_spanned == 1
    assert out.tokens[1] == want_chunk.tokens[0]
    assert out.logprobs[1] == want_chunk.logprobs[0]
    assert np.array_equal(out.logits[1], want_chunk.logits[0])
    assert np.array_equal(out.top_ids[1], want_chunk.top_ids[0])
    assert np.array_equal(out.top_logprobs[1], want_chunk.top_logprobs[0])
    for got, want in zip(_kv(sliced, 1, 80), _kv(whole, 1, 80)):
        assert np.array_equal(got, want)
    # within the budget: one expert's copy a step, besides the decode rows' own misses
    assert stage.experts.misses - misses_before > steps / 2


def test_with_every_expert_resident_nothing_changes(model_dirs):
    model = LocalModel(model_dirs["init_qwen3"], device="cpu")
    model.stages[0].chunk_copy_budget_bytes = 1
    _decode_ready(model)
    out = model.step(_mixed(3))
    assert out.pending_rows is None and model.stages[0].chunk is None and model.stages[0].chunk_steps == 0


def test_a_budget_of_zero_runs_the_chunk_whole(model_dirs):
    model = _model(model_dirs["init_qwen3"], None)
    _decode_ready(model)
    assert model.step(_mixed(3)).pending_rows is None and model.stages[0].chunk_steps == 0


@pytest.mark.parametrize("then", ["another feed", "absent twice", "runs whole", "another prompt"])
def test_the_held_chunk_is_dropped_when_the_steps_say_it_will_not_continue(model_dirs, then):
    model = _model(model_dirs["init_qwen3"], 1.0)
    stage = model.stages[0]
    _decode_ready(model)
    assert model.step(_mixed(3)).pending_rows is not None and stage.chunk is not None
    decode_only = StepBatch(slots=[0], starts=[4], lengths=[1], tokens=[22])
    if then == "another feed":  # the slot reused by another prompt
        model.step(_mixed(4, chunk=list(range(5, 90))))
        assert stage.chunk is not None and stage.chunk.length == 85
    elif then == "absent twice":  # one look-ahead step keeps it, a second step without it drops it
        model.step(decode_only)
        assert stage.chunk is not None
        model.step(StepBatch(slots=[0], starts=[5], lengths=[1], tokens=[23]))
        assert stage.chunk is None
    elif then == "another prompt":  # in another slot, while its own is absent once (cancelled)
        model.step(StepBatch(slots=[0, 2], starts=[4, 0], lengths=[1, 80], tokens=[22] + CHUNK))
        assert stage.chunk is not None and stage.chunk.slot == 2
    else:  # the same feed beside a second prompt: the step runs whole
        out = model.step(StepBatch(slots=[0, 1, 2], starts=[4, 0, 0], lengths=[1, 80, 5], tokens=[22] + CHUNK + [1] * 5))
        assert out.pending_rows is None and stage.chunk is None
    assert stage.chunks_dropped == 1


def test_a_held_chunk_alone_finishes_in_one_step(model_dirs):
    """Once nobody decodes beside it, the chunk's rest runs without a budget."""
    model = _model(model_dirs["init_qwen3"], 1.0)
    _decode_ready(model)
    assert model.step(_mixed(3)).pending_rows is not None
    out = model.step(StepBatch(slots=[1], starts=[0], lengths=[80], tokens=CHUNK))
    assert out.pending_rows is None and model.stages[0].chunk is None


def test_warm_runs_a_chunk_across_two_calls_and_leaves_nothing_behind(model_dirs, monkeypatch):
    """spanning_chunk.warm (a worker's start on cuda): a chunk stopped after its first expert group,
    then finished; afterwards the stage holds no chunk, and a prompt in slot 0 (where it wrote keys
    and values) reads the same as on a stage never warmed."""
    from moebus.workers import spanning_chunk

    calls = []
    advance = spanning_chunk.advance

    def spy(stage, chunk, budget_bytes, *rest):
        out = advance(stage, chunk, budget_bytes, *rest)
        calls.append((budget_bytes, out is None, chunk.within is not None))
        return out
    monkeypatch.setattr(spanning_chunk, "advance", spy)
    warmed, fresh = _model(model_dirs["init_qwen3"], 1.0), _model(model_dirs["init_qwen3"], 1.0)
    stage = warmed.stages[0]
    assert spanning_chunk.warm(stage, len(CHUNK))
    (first_budget, stopped, within), (second_budget, finished_pending, _) = calls
    assert first_budget == 0 and stopped and within  # stopped at a miss within a layer, its state kept
    assert second_budget is None and not finished_pending  # then to the sampled token
    assert stage.chunk is None and stage.chunks_spanned == stage.chunk_steps == 0
    for model in (warmed, fresh):
        _decode_ready(model)
    want = fresh.step(StepBatch(slots=[1], starts=[0], lengths=[80], tokens=CHUNK), want_logits=True)
    got = warmed.step(StepBatch(slots=[1], starts=[0], lengths=[80], tokens=CHUNK), want_logits=True)
    assert np.array_equal(got.logits, want.logits)
    assert not spanning_chunk.warm(stage, stage.max_context + 1)  # longer than the context: not run


def test_the_loan_is_held_across_the_chunks_steps_and_returned_when_the_cache_needs_it(model_dirs):
    """A chunk longer than the standing scratch holds the cache's lent slots from its first step to
    its end (a loan taken and returned each step would come back empty, and the steps between would
    admit into it); the steps between admit below it; a VRAM request or a long step of another prompt
    takes the loan back, and the chunk lends again at its next step."""
    from moebus.workers import spanning_chunk

    model = _model(model_dirs["init_qwen3"], 1.0)
    _decode_ready(model)
    _small_scratch(model)
    stage, experts = model.stages[0], model.stages[0].experts
    slots = experts.num_slots
    assert model.step(_mixed(3)).pending_rows is not None
    lent = stage.chunk.lent
    assert lent is not None and experts.loaned_from == lent[0] and experts.num_slots < slots
    model.step(StepBatch(slots=[0], starts=[4], lengths=[1], tokens=[22]))  # a look-ahead step between
    assert stage.chunk.lent == lent and experts.loaned_from == lent[0]
    assert max(experts.key_slot.values()) < lent[0]  # its admissions went below the lent slots
    assert np.all(experts.slot_key[lent[0]:lent[1]] == -1) and not set(experts.free) & set(range(*lent))
    spanning_chunk.return_loan(stage)  # what the worker does before a VRAM request
    assert experts.loaned_from is None and experts.num_slots == slots and stage.chunk is not None
    experts.resize(None, query=True)
    assert model.step(_mixed(5)).pending_rows is not None and stage.chunk.lent is not None
    other = model.step(StepBatch(slots=[2], starts=[0], lengths=[80], tokens=CHUNK))  # runs whole, its own loan
    assert other.pending_rows is None and stage.chunk is not None and stage.chunk.lent is None
    position = 6
    while model.step(_mixed(position)).pending_rows is not None:
        position += 1
        assert position < 400
    assert stage.chunk is None and experts.loaned_from is None and experts.num_slots == slots


@pytest.mark.parametrize("setup_step", [False, True])
@pytest.mark.parametrize("case", ["plain", "in pieces"])
def test_a_chunk_bounded_by_time_stops_between_groups_layers_and_pieces_and_equals_it_run_whole(model_dirs, case,
                                                                                             setup_step, monkeypatch):
    """A step whose deadline is past at its first look (a share of the decode rows' time near 0)
    runs one expert group (or enters a layer: its attention and routing; or, the chunk's first
    step, sets it up: chunk_advance.SETUP_STEP), then stops: within a layer, before a layer (its
    hidden state and last MLP output kept: with the copy budget alone it would go on to the next
    layer's attention and first group), before the first layer (the embedding kept) or before the
    next piece. The chunk's token, logits and keys and values still equal those of the chunk run
    whole."""
    monkeypatch.setattr(chunk_advance, "SETUP_STEP", setup_step)
    whole = _model(model_dirs["init_qwen3"], None)
    _decode_ready(whole)
    sliced = _model(model_dirs["init_qwen3"], 1.0)
    _decode_ready(sliced)
    if case == "in pieces":
        _small_scratch(whole)
        _small_scratch(sliced)
    want = whole.step(StepBatch(slots=[1], starts=[0], lengths=[80], tokens=CHUNK, top_logprobs=2), want_logits=True)
    stage = sliced.stages[0]
    stage.chunk_time_share = 1e-12
    groups, stops, read = [], {"within": 0, "layer": 0, "piece": 0, "setup": 0}, []
    run_group, read_input = chunk_advance.group_runner, chunk_advance.Uploads.__getitem__

    def counted(*args):
        run = run_group(*args)

        def each(first, end):
            groups[-1] += 1
            run(first, end)
        return each
    def reading(uploads, name):
        read[-1].add(name)
        return read_input(uploads, name)
    chunk_advance.group_runner, chunk_advance.Uploads.__getitem__, position = counted, reading, 3
    try:
        while True:
            groups.append(0)
            read.append(set())
            out = sliced.step(_mixed(position), want_logits=True)
            if out.pending_rows is None:
                break
            held = stage.chunk
            num_pieces = len(held.pieces)
            where = "within" if held.within is not None else "layer" if held.layer else \
                "setup" if held.x is not None else "piece"
            stops[where] += 1
            assert held.x is not None if where in ("layer", "setup") else held.x is None
            position += 1
            assert position < 400
    finally:
        chunk_advance.group_runner, chunk_advance.Uploads.__getitem__ = run_group, read_input
    # one group a step, however few its copies; none in a step that entered a layer (its attention
    # and routing were that step's progress), at most one such step a layer of a piece, and none in
    # the chunk's first (its setup: the first step only, SETUP_STEP)
    assert set(groups[:-1]) == {0, 1} and groups.count(0) <= len(stage.layer_range) * num_pieces + 1
    assert stops["setup"] == (1 if chunk_advance.SETUP_STEP else 0) and groups[0] == 0
    # a step's inputs are uploaded when read: the tokens in the steps that embed a piece, the
    # sampling's in the last, none in a step that only continues a layer's groups
    assert "tokens" in read[0] and "u" in read[-1] and "u" not in set().union(*read[:-1])
    assert sum(not names for names in read) >= stops["within"] - len(stage.layer_range) * num_pieces
    assert stops["within"] and stops["layer"] and (stops["piece"] if case == "in pieces" else not stops["piece"])
    assert out.tokens[1] == want.tokens[0] and np.array_equal(out.logits[1], want.logits[0])
    for got, wanted in zip(_kv(sliced, 1, 80), _kv(whole, 1, 80)):
        assert np.array_equal(got, wanted)


def test_an_image_chunks_decode_rows_replay_their_graph(model_dirs):
    """The decode rows of a step whose chunk carries an image's embeddings are selected with no
    image rows (an empty embedding array): their step is a plain decode step and takes the captured
    graph of its batch size, not an eager run of every kernel (the H200's 40-60 ms chunk steps of a
    LLaVA image beside 2 text streams, tenth session, against ~6 ms a decode step)."""
    from moebus.workers.batch import select_rows

    stage = _model(model_dirs["init_qwen3"], 1.0).stages[0]

    class Captured:  # what _graph_for asks of a captured step
        def matches(self, inputs):
            return True
    graph = stage.graphs[(1, False)] = Captured()
    stage.use_graphs = True
    step = _mixed(3, image=True)
    decode = select_rows(step, [0])
    assert decode.embeds is not None and len(decode.embeds) == 0
    assert stage._graph_for(decode, stage._host_inputs(decode, None)) is graph
    chunk = select_rows(step, [1])  # the chunk's own row keeps its image: never a graph
    assert len(chunk.embeds) and stage._graph_for(chunk, stage._host_inputs(chunk, None)) is None


def test_decode_rows_launched_beside_the_chunk_and_read_after_it_change_nothing(model_dirs):
    """chunk_rows.py (``stage.chunk_overlap``): from the chunk's second step the decode rows are
    launched as their captured graph (a stand-in here that runs them eagerly when launched) and
    read after the chunk's part of the step; the first step runs them synchronously (their time sets
    the next step's deadline). The decode row's tokens and logits and the chunk's token, logits and
    keys and values equal those of the steps run synchronously, bit for bit; the rows' routing
    still reaches the cache (``observe``)."""
    from types import SimpleNamespace

    from moebus.workers.batch import select_rows

    def mixed(position: int) -> StepBatch:  # no top logprobs: those rows are read from the device after the graph
        return StepBatch(slots=[0, 1], starts=[position, 0], lengths=[1, len(CHUNK)], tokens=[21] + CHUNK)

    class Captured:  # what _graph_for, Stage._forward and chunk_rows ask of a captured decode step
        def __init__(self, stage):
            self.stage, self.batch, self.launches, self.outputs = stage, None, 0, None

        def matches(self, inputs):
            return True

        def replay(self, inputs, names):
            host, self.outputs = self.stage._eager(self.batch, inputs, True, "logits" in names)
            return host

        def launch(self, inputs, names):
            self.launches += 1
            out = self.replay(inputs, names)
            return SimpleNamespace(collect=lambda: out)

    outs, models = [], []
    for overlapped in (False, True):
        model = _model(model_dirs["init_qwen3"], 1.0)
        _decode_ready(model)
        stage = model.stages[0]
        graph = stage.graphs[(1, False)] = Captured(stage)
        stage.use_graphs, stage.chunk_overlap = True, overlapped
        stage.chunk_time_share = 0.0  # the copy budget alone: the same groups a step either way
        observed, observe = [], stage.experts.observe
        stage.experts.observe = lambda chosen, ops=None: (observed.append(1), observe(chosen, ops))
        got, position = [], 3
        while True:
            step = mixed(position)
            graph.batch = select_rows(step, [0])
            out = model.step(step, want_logits=True)
            got.append(out)
            if out.pending_rows is None:
                break
            position += 1
            assert position < 400
        assert len(observed) == len(got)  # every step's decode row told the cache its experts
        assert graph.launches == (len(got) - 1 if overlapped else 0)
        assert stage.chunk is None and stage.chunks_spanned == 1
        outs.append(got)
        models.append(model)
    sync, over = outs
    assert len(sync) == len(over) > 3
    for a, b in zip(sync, over):
        assert a.tokens[0] == b.tokens[0] and np.array_equal(a.logits[0], b.logits[0])
    assert sync[-1].tokens[1] == over[-1].tokens[1] and np.array_equal(sync[-1].logits[1], over[-1].logits[1])
    for got, want in zip(_kv(models[1], 1, 80), _kv(models[0], 1, 80)):
        assert np.array_equal(got, want)


def test_an_overlapped_steps_deadline_follows_the_last_steps_decode_rows():
    """With the decode rows launched beside the chunk, the chunk's work ends the share of the last
    step's rows' time after the rows would end, and its first copies wait for the rows."""
    from types import SimpleNamespace

    from moebus.workers.spanning_chunk import overlapped_deadline

    held = SimpleNamespace(rows_s=0.008, copies_from=0.0)
    assert overlapped_deadline(SimpleNamespace(chunk_time_share=0.5), held, 10.0) == 10.0 + 1.5 * 0.008
    assert held.copies_from == 10.008
    assert overlapped_deadline(SimpleNamespace(chunk_time_share=0.0), held, 10.0) is None


def test_a_step_cap_ends_the_chunks_work_that_long_after_the_steps_start(monkeypatch):
    """MOEBUS_CHUNK_STEP_MS: the deadline no later than the cap after the step's start (the share's
    where it is earlier); where the time bound is off (a share of 0) there is none."""
    from types import SimpleNamespace

    from moebus.workers import spanning_chunk
    from moebus.workers.spanning_chunk import overlapped_deadline

    monkeypatch.setattr(spanning_chunk, "STEP_MS", 11.0)
    held = SimpleNamespace(rows_s=0.010, copies_from=0.0)
    assert overlapped_deadline(SimpleNamespace(chunk_time_share=0.5), held, 10.0) == 10.0 + 0.011
    held.rows_s = 0.004  # the share's is earlier: 10.006
    assert overlapped_deadline(SimpleNamespace(chunk_time_share=0.5), held, 10.0) == 10.0 + 1.5 * 0.004
    assert overlapped_deadline(SimpleNamespace(chunk_time_share=0.0), held, 10.0) is None
    stage = SimpleNamespace(chunk_time_share=100.0)
    started = __import__("time").perf_counter() - 1.0  # the rows took a second: the share's a hundred more
    assert spanning_chunk.chunk_deadline(stage, started) == started + 0.011


def test_under_a_step_cap_the_chunks_first_step_with_its_rows_run_first_does_no_chunk_work(model_dirs, monkeypatch):
    """MOEBUS_CHUNK_STEP_MS with the decode rows run synchronously (no graph launched beside the
    chunk): the chunk's first step runs the rows alone (no loan, no setup: the chunk is held, pending);
    the next sets it up (SETUP_STEP's step), then one unit a step; the chunk's token, logits and keys
    and values equal those of the chunk run whole, and the decode row's of each step its own."""
    from moebus.workers import spanning_chunk

    monkeypatch.setattr(spanning_chunk, "STEP_MS", 1e-9)  # past once the rows are done
    whole = _model(model_dirs["init_qwen3"], None)
    _decode_ready(whole)
    sliced = _model(model_dirs["init_qwen3"], 1.0)
    _decode_ready(sliced)
    _small_scratch(whole)
    _small_scratch(sliced)
    want = whole.step(StepBatch(slots=[1], starts=[0], lengths=[80], tokens=CHUNK, top_logprobs=2), want_logits=True)
    stage = sliced.stages[0]
    stage.chunk_time_share = 1.0
    out = sliced.step(_mixed(3), want_logits=True)
    held = stage.chunk
    assert out.pending_rows.tolist() == [1] and held.steps == held.idle_steps == 1
    assert held.lent is None and held.pieces is None and held.x is None and not held.kept
    out = sliced.step(_mixed(4), want_logits=True)  # its setup: the embedding kept, no layer entered
    assert out.pending_rows.tolist() == [1] and held.x is not None and held.layer == 0 and held.within is None
    assert held.lent is not None and held.idle_steps == 1
    position = 5
    while out.pending_rows is not None:
        out = sliced.step(_mixed(position), want_logits=True)
        position += 1
        assert position < 600
    assert stage.chunk is None and out.tokens[1] == want.tokens[0] and np.array_equal(out.logits[1], want.logits[0])
    for got, wanted in zip(_kv(sliced, 1, 80), _kv(whole, 1, 80)):
        assert np.array_equal(got, wanted)


@pytest.mark.parametrize("group_host", [True, False])
def test_a_later_group_starts_only_where_the_last_groups_host_time_fits(monkeypatch, group_host):
    """chunk_advance.GROUP_HOST: after a step's first group, the next starts only where the time left
    (here 10 ms at every look) exceeds the host time the last group took (here >= 20 ms: its plan,
    acquire and launches run with the GPU idle after the sync); off, it starts while any time is left."""
    import time
    from types import SimpleNamespace as NS

    experts = NS(num_slots=1, key_slot={}, store=NS(key=lambda layer, e: (layer, e), blob_bytes=1))
    chunk = NS(within=NS(routed=NS(unique=np.arange(4)), next_expert=0, tiles_plan=None),
               parts=NS(begin=lambda name: None),
               copies=0, group_host_s=0.0, copies_from=0.0)
    ran = []

    def runner(stage, layer, within, parts, experts=None):
        return lambda first, end: ran.append((first, end)) or time.sleep(0.02)
    monkeypatch.setattr(chunk_advance, "GROUP_HOST", group_host)
    monkeypatch.setattr(chunk_advance, "time_left", lambda stage, chunk, deadline: 0.01)
    monkeypatch.setattr(chunk_advance, "group_runner", runner)
    done = chunk_advance._run_groups(NS(experts=experts), chunk, 0, None, [0, False], time.perf_counter() + 1.0)
    assert chunk.group_host_s >= 0.02
    assert (done, ran) == ((False, [(0, 1)]) if group_host else (True, [(0, 1), (1, 2), (2, 3), (3, 4)]))


@pytest.mark.parametrize("case", ["plain", "in pieces"])
def test_a_chunk_whose_misses_go_to_staging_slots_equals_it_run_whole_and_leaves_the_cache_alone(model_dirs, case,
                                                                                                 monkeypatch):
    """chunk_advance.STAGING_SLOTS (spanning_chunk_staging.py): the chunk's loan takes 2 slots more,
    its groups read the cache's hits where they are and copy their misses (at most 2 a group) into
    those slots; the cache's own acquire (which evicts and admits) is never called for it. Its token,
    logits and keys and values still equal those of the chunk run whole. ``in pieces``: a loan that
    cannot cover its pieces' scratch and the staging slots too (this cache's few slots) stages
    nothing (shorter pieces would change its sums): the cache's acquire, as without."""
    monkeypatch.setattr(chunk_advance, "STAGING_SLOTS", 2)
    whole = _model(model_dirs["init_qwen3"], None)
    _decode_ready(whole)
    sliced = _model(model_dirs["init_qwen3"], 2.0)
    _decode_ready(sliced)
    if case == "in pieces":
        _small_scratch(whole)
        _small_scratch(sliced)
    want = whole.step(StepBatch(slots=[1], starts=[0], lengths=[80], tokens=CHUNK, top_logprobs=2), want_logits=True)
    stage = sliced.stages[0]
    experts = stage.experts
    cache_acquires = []
    acquire = experts.acquire

    def counted(*args):
        cache_acquires.append(stage.chunk is not None)
        return acquire(*args)
    monkeypatch.setattr(experts, "acquire", counted)
    position, staged = 3, []
    while True:
        out = sliced.step(_mixed(position), want_logits=True)
        if out.pending_rows is None:
            break
        held = stage.chunk
        if case == "in pieces":
            assert len(held.pieces) > 1 and held.staging is None
        else:
            lo, hi = held.staging
            assert hi == held.lent[1] and hi - lo == 2
        staged.append(held.staged.copies if held.staged is not None else 0)
        # nothing of the cache lies in the loan (the staging slots are out of its service)
        assert not set(experts.key_slot.values()) & set(range(*held.lent))
        position += 1
        assert position < 400
    assert position > 6
    if case == "plain":
        assert max(staged) > 0
        assert not any(cache_acquires)  # (the decode rows' steps read misses in place: no acquire either)
    assert stage.chunk is None and experts.loaned_from is None
    assert out.tokens[1] == want.tokens[0] and out.logprobs[1] == want.logprobs[0]
    assert np.array_equal(out.logits[1], want.logits[0])
    for got, wanted in zip(_kv(sliced, 1, 80), _kv(whole, 1, 80)):
        assert np.array_equal(got, wanted)


@pytest.mark.parametrize("plan_host", [True, False])
def test_a_group_that_makes_its_layers_plan_starts_only_where_the_last_such_groups_host_time_fits(monkeypatch,
                                                                                                 plan_host):
    """chunk_advance.PLAN_HOST: after a layer's entry (a step's progress), the layer's first group
    (it makes the layer's plan) starts only where the time left (10 ms) exceeds the host time the
    last such group took (here 20 ms), though the last group's (1 ms) would fit; off, it starts."""
    import time
    from types import SimpleNamespace as NS

    experts = NS(num_slots=1, key_slot={}, store=NS(key=lambda layer, e: (layer, e), blob_bytes=1))
    chunk = NS(within=NS(routed=NS(unique=np.arange(2)), next_expert=0, tiles_plan=None),
               parts=NS(begin=lambda n: None),
               copies=0, group_host_s=0.001, layer_plan_s=0.02, copies_from=0.0)
    ran = []

    def runner(stage, layer, within, parts, experts=None):
        return lambda first, end: ran.append((first, end))
    monkeypatch.setattr(chunk_advance, "PLAN_HOST", plan_host)
    monkeypatch.setattr(chunk_advance, "GROUP_HOST", True)
    monkeypatch.setattr(chunk_advance, "time_left", lambda stage, chunk, deadline: 0.01)
    monkeypatch.setattr(chunk_advance, "group_runner", runner)
    done = chunk_advance._run_groups(NS(experts=experts), chunk, 0, None, [0, True], time.perf_counter() + 1.0)
    assert (done, ran) == ((False, []) if plan_host else (True, [(0, 1), (1, 2)]))
