"""LLaVA's tower in slices (tower_slices.SLICE_LAYERS, issue 20): the slices run in turn with a cut
(a wait for the GPU, a pause) between them, eagerly and as one graph a slice, and give the unsliced
encode's bits. On the cpu backend and the simulator here; on a GPU (MOEBUS_TEST_GPU=1) the sliced
graph's replay too."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from moebus.common.image_processor import ImageProcessor  # noqa: E402
from moebus.common.vision_config import load_vision_config  # noqa: E402
from moebus.cuda.backends import make_backend  # noqa: E402
from moebus.cuda.kernels.compat import SIMULATOR  # noqa: E402
from moebus.workers import tower_graph, tower_slices  # noqa: E402
from moebus.workers.vision_model import VisionModel, load_vision_weights  # noqa: E402
from tests.vision_models import make_hf_llava, sample_images  # noqa: E402


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    d = make_hf_llava(tmp_path_factory.mktemp("slices") / "model", tower="siglip", feature_layer=[1, -1])
    proc = ImageProcessor.from_dir(d)
    px = np.stack([proc.preprocess(image) for image in sample_images()])[:1]
    return load_vision_config(d), load_vision_weights(d), px


@pytest.fixture
def pause(monkeypatch):
    monkeypatch.setattr(tower_slices, "SLICE_PAUSE_MS", 1.0)


def _encode(cfg, weights, px, device, per_slice, monkeypatch, times=1, capture_first=False):
    monkeypatch.setattr(tower_slices, "SLICE_LAYERS", per_slice)
    monkeypatch.setattr(tower_slices, "SLICE_CAPTURE_FIRST", capture_first)
    model = VisionModel(cfg, weights, make_backend(device))
    return [model.encode(px) for _ in range(times)], model


def test_the_forward_is_cut_into_slices_of_layers(llava):
    cfg, weights, _ = llava
    model = VisionModel(cfg, weights, make_backend("cpu"))
    kept = model._kept_buffers(1)
    assert cfg.num_layers_run == 3
    assert callable(model._slices(kept, 0)) and callable(model._slices(kept, 3)) and callable(model._slices(kept, 5))
    assert len(model._slices(kept, 1)) == 3 and len(model._slices(kept, 2)) == 2


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("per_slice", [1, 2])
def test_a_sliced_encode_gives_the_unsliced_bits(llava, device, per_slice, pause, monkeypatch):
    cfg, weights, px = llava
    (whole,), _ = _encode(cfg, weights, px, device, 0, monkeypatch)
    sliced, model = _encode(cfg, weights, px, device, per_slice, monkeypatch, times=2)
    for out in sliced:  # (on a GPU: the eager first encode, then the sliced graph's replay)
        np.testing.assert_array_equal(out, whole)
    cuts = -(-cfg.num_layers_run // per_slice) - 1
    assert model.graph.pacer.cuts == cuts and model.graph.pacer.seconds >= cuts * 1e-3
    assert f"{cuts + 1} slices" in model.graph.path()
    if not SIMULATOR and device == "cuda":
        assert isinstance(model.graph.graph.graph, tower_slices.SliceChain)
        assert len(model.graph.graph.graph.graphs) == cuts + 1 and model.graph.last_path == "replay"


@pytest.mark.skipif(SIMULATOR, reason="CUDA graphs need a GPU (MOEBUS_TEST_GPU=1)")
def test_a_sliced_encode_captured_and_launched_by_slice_gives_the_eager_bits(llava, pause, monkeypatch):
    from moebus.cuda.kernels import gemm

    cfg, weights, px = llava
    (whole,), _ = _encode(cfg, weights, px, "cuda", 0, monkeypatch)
    gemm._no_rows.cache_clear()  # made first inside the capture, as in a fresh vision worker (H200, 24th session)
    outs, model = _encode(cfg, weights, px, "cuda", 1, monkeypatch, times=2, capture_first=True)
    assert model.graph.enabled, "the capture failed: the tower went eager"
    for out in outs:  # the first encode without an eager run, then a replay of its slices
        np.testing.assert_array_equal(out, whole)
    assert isinstance(model.graph.graph.graph, tower_slices.SliceChain) and model.graph.last_path == "replay"
    assert model.capture_pending() is None


@pytest.mark.skipif(SIMULATOR, reason="CUDA graphs need a GPU (MOEBUS_TEST_GPU=1)")
def test_a_capture_a_synchronous_copy_invalidates_is_ended_and_the_encode_runs_eagerly(llava, pause, monkeypatch):
    """The twenty-fourth session's H200 run: a constant uploaded (cuda.to_device: a synchronous copy) first inside
    a slice's capture invalidated it; the builder left the stream capturing and the eager fallback's first
    synchronize was refused: the vision worker died. Now the capture is ended and the tower encodes eagerly."""
    from moebus.cuda.kernels.compat import cuda

    cfg, weights, px = llava
    (whole,), _ = _encode(cfg, weights, px, "cuda", 0, monkeypatch)
    sliced = VisionModel._slices

    def with_a_synchronous_copy(model, kept, per_slice=0):  # the first slice uploads a constant first
        slices = sliced(model, kept, per_slice)
        first = slices[0]
        return [lambda inputs: (cuda.to_device(np.zeros(1, np.int32)), first(inputs))[1]] + slices[1:]

    monkeypatch.setattr(VisionModel, "_slices", with_a_synchronous_copy)
    outs, model = _encode(cfg, weights, px, "cuda", 1, monkeypatch, times=2, capture_first=True)
    assert not model.graph.enabled and model.graph.last_path == "eager"
    for out in outs:
        np.testing.assert_array_equal(out, whole)


def test_an_unsliced_encode_has_no_cut(llava, monkeypatch):
    cfg, weights, px = llava
    _, model = _encode(cfg, weights, px, "cpu", 0, monkeypatch)
    assert model.graph.pacer.cuts == 0 and model.graph.path() == model.graph.last_path == "eager"


class _Graph:
    def __init__(self, name, events):
        self.name, self.events = name, events

    def launch(self, stream):
        self.events.append(("launch", self.name, stream))

    def close(self):
        self.events.append(("close", self.name))


class _Backend:
    def __init__(self, events):
        self.events = events

    def synchronize(self):
        self.events.append(("sync",))


def test_a_slice_chain_cuts_between_its_graphs_and_closes_them_all(monkeypatch):
    monkeypatch.setattr(tower_slices, "SLICE_PAUSE_MS", 0.0)
    events = []

    class Owner:
        pacer = tower_slices.Pacer(_Backend(events))

    chain = tower_slices.SliceChain([_Graph(i, events) for i in range(3)], Owner)
    chain.launch("s")
    chain.close()
    assert events == [("launch", 0, "s"), ("sync",), ("launch", 1, "s"), ("sync",), ("launch", 2, "s"),
                      ("close", 0), ("close", 1), ("close", 2)]
    assert Owner.pacer.cuts == 2


def test_run_slices_hands_back_the_last_slices_outputs():
    events = []
    pacer = tower_slices.Pacer(_Backend(events))
    slices = [lambda x: events.append("a") or {}, lambda x: {"y": x["v"] + 1}]
    assert tower_slices.run_slices(slices, {"v": 1}, pacer) == {"y": 2}
    assert tower_slices.run_slices(slices[1], {"v": 2}, pacer) == {"y": 3}
    assert events == ["a", ("sync",)] and pacer.cuts == 1


class _Nvml:
    def __init__(self, percents):
        self.percents = list(percents)

    def busy_percent(self):
        return self.percents.pop(0)


def test_the_busy_gate_cuts_only_on_a_busy_gpu(monkeypatch):
    from moebus.workers.vision_worker import SliceGate

    monkeypatch.setattr(tower_slices, "SLICE_BUSY_PERCENT", 25)
    events = []

    class Graph:
        pacer = tower_slices.Pacer(_Backend(events))

    gate = SliceGate("cuda", make_nvml=lambda: _Nvml([80, 3]))
    assert gate.apply(Graph) == ", GPU 80% busy: slices cut" and Graph.pacer.on
    assert gate.apply(Graph) == ", GPU 3% busy: slices back to back" and not Graph.pacer.on
    assert tower_slices.run_slices([lambda x: {}, lambda x: {"y": 1}], {}, Graph.pacer) == {"y": 1}
    assert events == [] and Graph.pacer.cuts == 0  # uncut: no wait, no pause
    assert SliceGate("cpu").apply(Graph) == ""  # no NVML: the pacer is left as it is (cut always)


class _LaunchFirst:
    """DeferredCapture's interface for a sliced forward captured and launched by slice (no GPU: the
    "graphs" run their slice when launched)."""

    def __init__(self, backend, host_inputs, forward, owner=None, eager=True):
        self.inputs, self.forward, self.owner, self.graph, self.eager = dict(host_inputs), forward, owner, None, eager
        self.specs, self.flags, self.stream = {n: a.shape for n, a in host_inputs.items()}, None, "s"

    def capture_launching(self):
        events, graphs = [], []
        for i, stage in enumerate(self.forward):
            graphs.append(_Graph(i, events))
            if i:
                self.owner.pacer.cut()
            self.out = stage(self.inputs)
        self.graph = tower_slices.SliceChain(graphs, self.owner)

    def matches(self, host_inputs):
        return {n: a.shape for n, a in host_inputs.items()} == self.specs

    def close(self):
        pass


def test_capture_first_launches_a_new_shape_by_slice_without_an_eager_run(monkeypatch):
    monkeypatch.setattr(tower_slices, "SLICE_CAPTURE_FIRST", True)
    monkeypatch.setattr(tower_slices, "SLICE_PAUSE_MS", 0.0)
    monkeypatch.setattr(tower_graph, "DeferredCapture", _LaunchFirst)
    monkeypatch.setattr(tower_graph, "pinned_out", lambda graph: graph.out)
    graph = tower_graph.TowerGraph(make_backend("cpu"))
    graph.enabled = True  # as on a GPU
    slices = [lambda x: {}, lambda x: {"y": x["x"] * 2}]
    out = graph.run("a", {"x": np.ones(3, np.float32)}, slices)
    assert not graph.graph.eager and graph.last_path == "new shape, captured and launched by slice"
    assert graph.pacer.cuts == 1 and "2 slices" in graph.path() and graph.capture_pending() is None
    np.testing.assert_array_equal(out["y"], 2 * np.ones(3))
    # an unsliced forward keeps the eager first encode
    monkeypatch.setattr(tower_graph, "DeferredCapture", lambda *a, **k: (_ for _ in ()).throw(AssertionError(k)))
    graph.close()
    graph.enabled = False
    assert graph.run("b", {"x": np.ones(2, np.float32)}, slices[1])["y"].tolist() == [2.0, 2.0]
