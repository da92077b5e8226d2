"""When the vision tower's graph of a new image size is captured (workers/tower_graph.py): its first
encode runs eagerly and returns at once; the capture follows the reply (``capture_pending``) or the
size's next encode, and later encodes replay it; a new size drops the old graph; a capture that
fails leaves the tower eager. The graph machinery is a stand-in here (CapturedStep needs a GPU;
there, tests/vision/test_qwen3vl_units.py and test_vision_model.py check replay == eager bit for bit)."""
import numpy as np
import pytest

from moebus.workers import tower_graph, tower_outputs


class FakeCapture:
    """DeferredCapture's interface: ``forward`` runs at construction (eagerly) and again at capture
    (recorded, not run); the graph's launch runs the recorded forward on the uploaded inputs."""

    instances = []
    fail_capture = False

    def __init__(self, backend, host_inputs, forward, owner=None, eager=True):
        self.specs = {n: a.shape for n, a in host_inputs.items()}
        self.forward, self.graph, self.closed, self.stream = forward, None, False, None
        self.flags = np.zeros(4, np.int32)  # (COLLECT_BESIDE's words: unused here)
        self.eager = forward(dict(host_inputs))
        FakeCapture.instances.append(self)

    def matches(self, host_inputs):
        return {n: a.shape for n, a in host_inputs.items()} == self.specs

    def eager_results(self):
        return self.eager

    def capture(self):
        if FakeCapture.fail_capture:
            raise RuntimeError("no capture here")
        self.graph, self.forward = FakeGraph(self, self.forward), None

    def close(self):
        self.closed = True


class FakeGraph:
    def __init__(self, capture, forward):
        self.capture, self.forward, self.inputs, self.out = capture, forward, None, None

    def launch(self, stream):
        self.out = self.forward(self.inputs)


@pytest.fixture
def tower(monkeypatch):
    FakeCapture.instances, FakeCapture.fail_capture = [], False
    monkeypatch.setattr(tower_graph, "DeferredCapture", FakeCapture)
    monkeypatch.setattr(tower_graph, "upload", lambda graph, inputs: setattr(graph.graph, "inputs", dict(inputs)))
    monkeypatch.setattr(tower_graph, "pinned_out", lambda graph: graph.graph.out)
    from moebus.cuda.backends import make_backend

    graph = tower_graph.TowerGraph(make_backend("cpu"))
    graph.enabled = True  # as on a GPU
    calls = []

    def forward(inputs):
        calls.append(inputs["x"].shape)
        return {"y": inputs["x"] * 2}

    return graph, forward, calls


def _x(rows, value=1.0):
    return {"x": np.full((rows, 3), value, np.float32)}


def test_a_new_size_runs_eagerly_and_is_captured_after_its_reply(tower):
    graph, forward, calls = tower
    out = graph.run("a", _x(4), forward)
    assert graph.last_path == "new shape, eager" and len(calls) == 1 and graph.graph.graph is None
    np.testing.assert_array_equal(out["y"], 2 * np.ones((4, 3)))
    assert graph.capture_pending() is not None and len(calls) == 1  # recorded, not run (the fake runs at launch)
    assert graph.capture_pending() is None  # nothing left to capture
    out = graph.run("a", _x(4, 3.0), forward)
    assert graph.last_path == "replay" and len(FakeCapture.instances) == 1
    np.testing.assert_array_equal(out["y"], 6 * np.ones((4, 3)))


def test_a_size_seen_again_before_the_capture_captures_then_replays(tower):
    graph, forward, calls = tower
    graph.run("a", _x(4), forward)
    out = graph.run("a", _x(4, 5.0), forward)
    assert graph.last_path == "replay" and graph.graph.graph is not None
    np.testing.assert_array_equal(out["y"], 10 * np.ones((4, 3)))


def test_a_new_size_drops_the_old_graph(tower):
    graph, forward, calls = tower
    graph.run("a", _x(4), forward)
    graph.capture_pending()
    graph.run("b", _x(6), forward)
    first, second = FakeCapture.instances
    assert first.closed and not second.closed and graph.key == "b" and graph.last_path == "new shape, eager"


def test_eager_first_off_captures_with_the_first_encode(tower, monkeypatch):
    graph, forward, calls = tower
    monkeypatch.setattr(tower_graph, "EAGER_FIRST", False)
    out = graph.run("a", _x(4), forward)
    assert graph.last_path == "new shape, eager and captured" and graph.graph.graph is not None
    np.testing.assert_array_equal(out["y"], 2 * np.ones((4, 3)))
    assert graph.capture_pending() is None


def test_a_failed_capture_leaves_the_tower_eager(tower, caplog):
    graph, forward, calls = tower
    FakeCapture.fail_capture = True
    graph.run("a", _x(4), forward)
    assert graph.capture_pending() is None and not graph.enabled and graph.graph is None
    assert "capture of the vision tower failed" in caplog.text
    out = graph.run("a", _x(4, 2.0), forward)  # the backend's own eager path
    assert graph.last_path == "eager"
    np.testing.assert_array_equal(out["y"], 4 * np.ones((4, 3)))


def test_the_flag_kernel_raises_one_word():
    from moebus.cuda.kernels.compat import cuda

    flags = cuda.to_device(np.zeros(4, np.int32))
    tower_outputs.raise_flag_kernel()[1, 1](flags, 2)
    assert flags.copy_to_host().tolist() == [0, 0, 1, 0]


def test_collect_reads_plain_outputs_at_once():
    out = {"deepstack0": np.ones((2, 3), np.float32), "embeds": np.zeros((2, 3), np.float32)}
    embeds, stacked = tower_outputs.embeds_and_deepstack(out)
    assert stacked.shape == (1, 2, 3) and stacked.sum() == 6 and not embeds.any()
    assert tower_graph._copies(out)["deepstack0"] is not out["deepstack0"]


def test_an_eager_run_copies_what_its_forward_emits_into_pinned_buffers(monkeypatch):
    """The eager half of DeferredCapture on the simulator (its stream handles stand in: the simulator
    runs each launch to its end, so there is nothing to fork or join)."""
    from moebus.cuda.backends import graphs
    from moebus.cuda.backends.cuda import CudaBackend

    monkeypatch.setattr(graphs, "_core_stream", lambda stream: stream)
    monkeypatch.setattr(graphs, "_record_and_wait", lambda event, recorder, waiter: None)
    ops = CudaBackend()
    owner = tower_graph.TowerGraph(ops)

    def forward(inputs):
        early = ops.add(inputs["x"], inputs["x"])
        owner.emit("early", early)
        return {"early": early, "late": ops.add(early, inputs["x"])}

    capture = tower_graph.DeferredCapture(ops, {"x": np.ones((4, 3), np.float32)}, forward, owner)
    out = capture.eager_results()
    assert set(capture.early) == {"early"} and out["early"] is capture.early["early"] and capture.emitted == 1
    assert owner.sink is None  # only while its forward runs
    np.testing.assert_array_equal(out["early"], np.full((4, 3), 2, np.float32))
    np.testing.assert_array_equal(out["late"], np.full((4, 3), 3, np.float32))
    owner.emit("elsewhere", out["late"])  # outside a graph's run: nothing
    assert set(capture.early) == {"early"}
    if tower_graph.COLLECT_BESIDE:  # (the default) the early output's flag raised after its copy
        assert capture.flag_of == {"early": 0} and capture.flags[0] == 1
