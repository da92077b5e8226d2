"""A vision tower's encode as one CUDA graph (cuda/backends/graphs.py's CapturedStep): an encode is
hundreds of launches (~30 us each from Python) over a few ms of GPU work, so on cuda the encode of
the last input shape is captured once and replayed (one input copy, one launch, the outputs copied
back into pinned memory). A new shape replaces the graph (its scratch goes with it), so a tower
holds one encode's scratch as before.

The first encode of a new shape runs **eagerly** in the graph-to-be's own scratch pool and returns
its results; the capture (no GPU work, but the launches again from Python, the graph's
instantiation and its pinned buffers: 80-117 ms for Qwen3-VL's a3b tower at 64 x 64 patches on the
H200) waits for ``capture_pending``, which the vision worker calls once the reply has left
(workers/vision_worker.py), or for the next encode of that shape. So a cold image request pays one
eager pass, not a pass and a capture, and the capture records the same launches into the same
buffers (the pool hands them out in the same order), so the graph's results equal the eager ones
bit for bit. Elsewhere (cpu, the simulator,
MOEBUS_CUDA_GRAPHS=0, a capture that fails) the same ``forward`` runs eagerly.

``forward(inputs)`` takes the device inputs by name and returns the device outputs by name; it
must only enqueue work (no host copy, no sync; graphs.py), and the same shapes must take the same
path. ``collect(outputs)`` makes the caller's host results out of the host outputs by name, which
may be the graph's pinned buffers (overwritten by the next encode): it must copy what it keeps, and
so the outputs are copied once (the default: a copy of each; Qwen3-VL stacks its DeepStack features
in the same copy). An output that ``forward`` hands to ``TowerGraph.emit`` as soon as it is final
(Qwen3-VL's DeepStack features, made after blocks 8, 16 and 24 of 27) is copied into pinned host
memory on a second stream from then on, inside the graph as a parallel branch, while the later
blocks run; only the outputs made last are copied after the last kernel. The host copies of a
replay (the inputs into the pinned staging, the outputs out of the pinned buffers: ~28 MB for a
1024 x 768 image on Qwen3-VL, its bytes in and four outputs out) run in COPY_THREADS slices at once
(``copy_pairs``: numpy lets the GIL go while it copies).

A ``forward`` may also be a list of slices (tower_slices.py; LLaVA's tower cut every SLICE_LAYERS layers:
issue 20, off by default): they run in turn with a cut between them (``Pacer``: a wait for the GPU, then a
pause in which a text worker's steps have the GPU alone), eagerly, and captured as one graph a slice
(``SliceChain``) launched the same way; a sliced forward must not ``emit``."""
from __future__ import annotations

import functools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from moebus.cuda.backends import passes_capture
from moebus.workers import tower_slices
from moebus.workers.tower_slices import Pacer, SliceChain, run_slices
from moebus.workers.tower_outputs import MAX_FLAGS, ReadyOutputs, raise_flag_kernel, ready

log = logging.getLogger("moebus.vision")
COPY_THREADS = int(os.environ.get("MOEBUS_TOWER_COPY_THREADS", "4"))  # 1: plain numpy copies
COPY_SLICE_BYTES = 2 << 20  # copies are cut into slices of this size, COPY_THREADS at a time
# 0: a new shape's first encode runs eagerly and is captured at once (the ninth session's way, for A/Bs)
EAGER_FIRST = os.environ.get("MOEBUS_TOWER_EAGER_FIRST", "1") != "0"
# 0: the outputs a forward ``emit``s early are copied out after the last kernel like the others (for A/Bs)
EARLY_COPIES = os.environ.get("MOEBUS_TOWER_EARLY_COPIES", "1") != "0"
# 1 (default): a replay's ``collect`` may copy each early output out of its pinned buffer as soon as the graph
# raised its flag (a word of mapped host memory a one-thread kernel sets after the copy), while the later blocks
# still run, instead of after the whole graph (0). On the H200 the a3b tower's 1024 x 768 encode 31.4 -> 30.3 ms,
# bit for bit (fifteenth session; the eleventh's 31.2 -> 30.6)
COLLECT_BESIDE = os.environ.get("MOEBUS_TOWER_COLLECT_BESIDE", "1") != "0"
# Issue 20, second round (off by default: calls B and C did not show the capture stretching the text steps; the
# slow steps beside it are the image's first chunk steps; docs/performance.md). The capture after the reply runs
# while the text workers decode (call A: a 29.5 ms chunk step, 9-14 ms over its peers, ended inside a 59.8 ms
# capture). It makes no GPU work, but driver calls: cuMemHostAlloc for its pinned staging and outputs (pinning maps the pages for the
# GPU) and the graph's instantiation. PIN_AHEAD 1: the pinned staging is allocated with the eager encode (its
# inputs go up through it) and the outputs' pinned buffers with its results (read back through them), so the
# capture allocates no host memory; same bits.
PIN_AHEAD = os.environ.get("MOEBUS_TOWER_PIN_AHEAD", "0") == "1"
# When the vision worker captures a new shape's graph (vision_worker.CaptureAfterReply): "reply" (default) right
# after the reply; "idle" once NVML sees the GPU under CAPTURE_BUSY_PERCENT busy (polled while the worker waits
# for its next message; no NVML: after the reply), so not while text workers decode; "next" never after a reply:
# the next encode of that shape captures it (and pays the capture: 60-120 ms on the H200) before its replay.
CAPTURE_WHEN = os.environ.get("MOEBUS_TOWER_CAPTURE_WHEN", "reply")
CAPTURE_BUSY_PERCENT = int(os.environ.get("MOEBUS_TOWER_CAPTURE_BUSY_PERCENT", "10"))


class TowerGraph:
    def __init__(self, backend):
        from moebus.cuda.backends.graphs import graphs_available

        self.ops = backend
        self.enabled = backend.name == "cuda" and graphs_available() and os.environ.get("MOEBUS_CUDA_GRAPHS", "1") != "0"
        self.key = None
        self.graph = None  # a DeferredCapture: the last shape's pool, its graph once captured
        self.last_path = None  # how the last run went: "eager", "new shape, eager", "captured", "replay"
        self.sink = None  # the DeferredCapture whose forward runs now (``emit``)
        self.pacer = Pacer(backend)  # the pauses between a sliced forward's slices (SLICE_LAYERS)
        self.capture_parts = ""  # the last capture_pending's parts (DeferredCapture.parts)

    def emit(self, name: str, array) -> None:
        """Called by ``forward`` once its output ``name`` is final (no later launch writes it): inside a
        graph's eager run or capture, its copy to pinned host memory starts now on a second stream,
        beside the launches that follow; elsewhere nothing happens (it is copied with the others)."""
        if self.sink is not None and EARLY_COPIES:
            self.sink.emit(name, array)

    def run(self, key, host_inputs: dict[str, np.ndarray], forward, collect=None):
        """``collect`` (default: copies by name) of ``forward``'s outputs for these inputs; ``key``
        names what else the captured work depends on (buffers sized by it), so a new key captures anew."""
        collect = collect or _copies
        self.pacer.reset()
        if self.enabled:
            host_outputs = self._graph_outputs(key, host_inputs, forward)
            if host_outputs is not None:
                try:
                    return collect(host_outputs)
                finally:
                    if isinstance(host_outputs, ReadyOutputs):
                        host_outputs.finish()  # the graph has ended before the next upload
        self.last_path = "eager"
        ops = self.ops
        ops.begin_step()
        outputs = run_slices(forward, {name: ops.upload(array) for name, array in host_inputs.items()}, self.pacer)
        return collect({name: ops.to_host(array) for name, array in outputs.items()})

    def path(self) -> str | None:
        """How the last run went, with its slices and their pauses where it was sliced (the worker's log)."""
        if not self.pacer.cuts:
            return self.last_path
        return f"{self.last_path}, {self.pacer.cuts + 1} slices, {1e3 * self.pacer.seconds:.1f} ms in their cuts"

    def _graph_outputs(self, key, host_inputs: dict, forward) -> dict | None:
        """The host outputs through this shape's graph (a replay, or a new shape's eager run in the
        graph's pool); None where it must run eagerly (a capture that failed)."""
        graph = self.graph
        if graph is not None and self.key == key and graph.matches(host_inputs):
            if graph.graph is None and not self._capture():  # seen again before capture_pending
                return None
            self.last_path = "replay"
            upload(graph, host_inputs)
            if graph.flags is not None:
                graph.flags[:] = 0  # (the last replay has ended: its collect waited for it)
            graph.graph.launch(graph.stream)
            return pinned_out(graph)
        self.close()  # the old graph's scratch goes before the new one's comes
        launch_first = tower_slices.SLICE_CAPTURE_FIRST and isinstance(forward, (list, tuple))
        try:
            graph = DeferredCapture(self.ops, host_inputs, forward, self, eager=not launch_first)
            self.graph, self.key = graph, key
            if launch_first:
                graph.capture_launching()
                self.last_path = "new shape, captured and launched by slice"
                return pinned_out(graph)
            if not EAGER_FIRST and not self._capture():
                return None
        except Exception as e:  # noqa: BLE001 - a driver or binding that cannot capture: encode eagerly
            if passes_capture(e):
                raise
            log.warning("CUDA graph capture of the vision tower failed (%s: %s); it encodes eagerly",
                        type(e).__name__, e)
            self.close()
            self.enabled = False
            return None
        self.last_path = "new shape, eager" if graph.graph is None else "new shape, eager and captured"
        return graph.eager_results()  # a capture runs nothing: the eager run's buffers still hold them

    def pending(self) -> bool:
        """Whether a shape has run eagerly and waits for its capture (``capture_pending``)."""
        return self.enabled and self.graph is not None and self.graph.graph is None

    def capture_pending(self) -> float | None:
        """Capture the graph of the shape that has only run eagerly so far (after its reply has
        left): the seconds it took, or None when there was nothing to capture (or it failed).
        ``capture_parts`` then says where its host time went (the worker's log)."""
        if not self.pending():
            return None
        started = time.perf_counter()
        done = self._capture()
        self.capture_parts = getattr(self.graph, "parts", "") if done else ""
        return time.perf_counter() - started if done else None

    def _capture(self) -> bool:
        try:
            self.graph.capture()
            return True
        except Exception as e:  # noqa: BLE001 - as in _graph_outputs: encode eagerly from now on
            if passes_capture(e):
                raise
            log.warning("CUDA graph capture of the vision tower failed (%s: %s); it encodes eagerly",
                        type(e).__name__, e)
            self.close()
            self.enabled = False
            return False

    def close(self) -> None:
        """Drop the captured graph (before buffers it reads are replaced, or to free its scratch)."""
        if self.graph is not None:
            self.graph.close()
        self.graph, self.key = None, None


@functools.cache
def _deferred_capture_class():
    """DeferredCapture's base is graphs.py's CapturedStep, imported on first use (numba.cuda: not
    in the broker, which imports this module through vision_model.py)."""
    from moebus.cuda.backends import graphs
    from moebus.cuda.kernels.compat import SIMULATOR, cuda
    from moebus.cuda.memory.step_pool import StepPool

    class _DeferredCapture(graphs.CapturedStep):
        """CapturedStep in two halves: the eager run in the graph's own pool now (it allocates every
        buffer and does the encode's real work), the capture of the same launches later
        (``capture``), into the same buffers: the pool hands them out again in the same order."""

        def __init__(self, backend, host_inputs: dict, forward, owner=None, eager: bool = True):
            self.backend, self.shared_pool, self.owner = backend, False, owner
            self.specs = {name: (a.shape, a.dtype) for name, a in host_inputs.items()}
            self.offsets, self.total_bytes = graphs._layout(host_inputs)
            self.packed = cuda.device_array(self.total_bytes, np.uint8)
            self.inputs = {name: self._view(self.packed, name) for name in self.specs}
            self.pool = StepPool(lambda shape, dtype: cuda.device_array(shape, dtype=dtype))
            self.stream = graphs._core_stream(backend.stream)
            self.forward, self.graph, self.launches = forward, None, None
            self.early, self.emitted = {}, 0  # pinned host buffers of the outputs forward emitted, by name
            self.flag_of, self.flags = {}, None  # early output -> its word in ``flags`` (COLLECT_BESIDE, made then)
            self.side = cuda.stream()  # the early copies' (simulator: no events; it has nothing to order)
            events = (None, None) if SIMULATOR else (cuda.event(timing=False), cuda.event(timing=False))
            self.forked, self.joined = events
            self.staging = self.host_outputs = None
            self.recorded_s, self.parts = 0.0, ""  # the capture's host time in the forward's launches; its log
            with backend.private_pool(self.pool):
                if PIN_AHEAD and eager:  # the staging now: the capture allocates none (see PIN_AHEAD)
                    self._pin_staging()
                    upload(self, host_inputs)
                else:
                    for name, view in self.inputs.items():  # pageable: no pinned staging until the capture
                        if view.size:
                            view.copy_to_device(np.ascontiguousarray(host_inputs[name]), stream=backend.stream)
                self.eager_outputs = self._run(forward) if eager else None

        def _pin_staging(self) -> None:
            if self.staging is None:
                self.staging = cuda.pinned_array(self.total_bytes, np.uint8)
                self.host_views = {name: self._view(self.staging, name) for name in self.specs}

        def _pin_outputs(self, outputs: dict) -> None:
            if self.host_outputs is None:
                self.host_outputs = {name: self.early.get(name) if name in self.early else
                                     cuda.pinned_array(a.shape, a.dtype) for name, a in outputs.items()}

        def _run(self, forward) -> dict:
            """forward over the inputs, its emitted outputs' copies on the side stream, joined at the end."""
            copies = len(self.early)
            if self.owner is not None:
                self.owner.sink = self
            try:
                outputs = run_slices(forward, self.inputs, self.owner.pacer if self.owner is not None else None)
            finally:
                if self.owner is not None:
                    self.owner.sink = None
                if self.emitted:
                    graphs._record_and_wait(self.joined, self.side, self.backend.stream)
            if copies and self.emitted != copies:  # the capture must emit what the eager run did
                raise RuntimeError(f"the forward emitted {self.emitted} outputs, its eager run {copies}")
            return outputs

        def emit(self, name: str, array) -> None:
            """Copy ``array`` into pinned host memory on the side stream once the launches so far are done."""
            if name not in self.early:
                self.early[name] = cuda.pinned_array(array.shape, array.dtype)
            graphs._record_and_wait(self.forked, self.backend.stream, self.side)
            array.copy_to_host(self.early[name], stream=self.side)
            if COLLECT_BESIDE and (name in self.flag_of or len(self.flag_of) < MAX_FLAGS):
                if self.flags is None:
                    self.flags = cuda.mapped_array(MAX_FLAGS, np.int32)
                    self.flags[:] = 0
                index = self.flag_of.setdefault(name, len(self.flag_of))
                flags = self.flags if SIMULATOR else cuda.as_cuda_array(self.flags)  # (the simulator's: host memory)
                raise_flag_kernel()[1, 1, self.side](flags, index)
            self.emitted += 1

        def eager_results(self) -> dict[str, np.ndarray]:
            """The eager run's outputs on the host: copies, or (PIN_AHEAD) the graph-to-be's pinned
            buffers, which the caller's ``collect`` copies (as it does a replay's)."""
            if PIN_AHEAD:
                self._pin_outputs(self.eager_outputs)
                for name, array in self.eager_outputs.items():
                    if name not in self.early:
                        array.copy_to_host(self.host_outputs[name], stream=self.backend.stream)
            self.backend.synchronize()  # (joined: the side stream's copies too)
            if PIN_AHEAD:
                return dict(self.host_outputs)
            return {name: self.early[name] if name in self.early else self.backend.to_host(array)
                    for name, array in self.eager_outputs.items()}

        def capture(self) -> None:
            began = time.perf_counter()
            self._pin_staging()
            pinned = time.perf_counter()
            self.recorded_s = 0.0
            with self.backend.private_pool(self.pool):
                self.backend.synchronize()  # the eager run no longer uses the buffers
                self.pool.recycle()
                self.emitted = 0
                if isinstance(self.forward, (list, tuple)):  # one graph a slice, launched in turn (SliceChain)
                    if self.early:
                        raise RuntimeError("a sliced forward emitted outputs: its slices cannot be captured apart")
                    graphs = [self._capture(self._timed(stage)) for stage in self.forward]
                    outputs, graph = graphs[-1][0], SliceChain([g for _, g in graphs], self.owner)
                else:
                    outputs, graph = self._capture(self._timed(self._run_forward))
            captured = time.perf_counter()
            self._pin_outputs(outputs)
            self.outputs, self.graph, self.forward = outputs, graph, None
            self.parts = (f"staging pinned {1e3 * (pinned - began):.1f} ms, launches recorded "
                          f"{1e3 * self.recorded_s:.1f} ms, instantiated (and the rest) "
                          f"{1e3 * (captured - pinned - self.recorded_s):.1f} ms, "
                          f"outputs pinned {1e3 * (time.perf_counter() - captured):.1f} ms")

        def _timed(self, run):
            """``run`` with its host time added to ``recorded_s`` (the capture's log splits it from the rest)."""
            def timed(inputs):
                started = time.perf_counter()
                try:
                    return run(inputs)
                finally:
                    self.recorded_s += time.perf_counter() - started
            return timed

        def capture_launching(self) -> None:
            """A sliced forward without an eager run: each slice captured into the pool (its buffers
            allocated as it records) and its graph launched at once, the next slice recorded while it
            runs; the owner's pacer cuts before each launch after the first. The outputs are the last
            slice's (``pinned_out`` copies them)."""
            self._pin_staging()
            pacer, graphs = (self.owner.pacer if self.owner is not None else None), []
            try:
                with self.backend.private_pool(self.pool):
                    for i, stage in enumerate(self.forward):
                        outputs, graph = self._capture(stage)
                        graphs.append(graph)
                        if i and pacer is not None:
                            pacer.cut()
                        graph.launch(self.stream)
            except BaseException:
                for graph in graphs:
                    graph.close()
                raise
            self._pin_outputs(outputs)
            self.outputs, self.graph, self.forward = outputs, SliceChain(graphs, self.owner), None

        def _run_forward(self, inputs) -> dict:
            return self._run(self.forward)

        def close(self) -> None:
            if self.graph is not None:
                self.graph.close()
            self.pool.release()

    return _DeferredCapture


def DeferredCapture(backend, host_inputs: dict, forward, owner=None, eager=True):  # noqa: N802 - made on first use
    """A new shape's eager run in its graph-to-be's pool (see _deferred_capture_class); ``owner``: the
    TowerGraph whose ``emit`` reaches it while its forward runs; ``eager`` False: the inputs uploaded only
    (``capture_launching`` follows)."""
    return _deferred_capture_class()(backend, host_inputs, forward, owner, eager)


def upload(graph, host_inputs: dict) -> None:
    """CapturedStep's upload with the host copies into its pinned staging in slices at once."""
    copy_pairs([(graph.host_views[name], host_inputs[name]) for name in graph.host_views])
    graph.packed.copy_to_device(graph.staging, stream=graph.backend.stream)


def pinned_out(graph) -> dict[str, np.ndarray]:
    """The outputs copied into the graph's pinned buffers (as CapturedStep.replay, less its copies):
    all of them once the graph has ended, or (flagged early outputs) a ReadyOutputs whose ``ready``
    waits for one output at a time."""
    stream = graph.backend.stream
    for name, array in graph.outputs.items():
        if name not in graph.early:  # (the emitted ones were copied inside the graph, beside its kernels)
            array.copy_to_host(graph.host_outputs[name], stream=stream)
    if graph.flag_of:
        return ReadyOutputs(graph)
    stream.synchronize()
    return graph.host_outputs


def copy_pairs(pairs) -> None:
    """dst[...] = src for each (dst, src) pair of equal shapes; contiguous pairs of one dtype go in
    slices of COPY_SLICE_BYTES, COPY_THREADS at a time (a fresh dst's page faults too)."""
    slices = []
    for dst, src in pairs:
        src = np.asarray(src)
        if dst.shape != src.shape:
            raise ValueError(f"copy of {src.shape} into {dst.shape}")
        if COPY_THREADS <= 1 or dst.dtype != src.dtype or not (dst.flags.c_contiguous and src.flags.c_contiguous):
            dst[...] = src
            continue
        flat_dst, flat_src = dst.reshape(-1), src.reshape(-1)
        step = max(COPY_SLICE_BYTES // max(dst.itemsize, 1), 1)
        slices += [(flat_dst[i:i + step], flat_src[i:i + step]) for i in range(0, flat_dst.size, step)]
    if len(slices) > 1:
        list(_copy_pool().map(_copy_slice, slices))
    elif slices:
        _copy_slice(slices[0])


def copied(array) -> np.ndarray:
    """A fresh copy of ``array`` (copy_pairs)."""
    out = np.empty(array.shape, array.dtype)
    copy_pairs([(out, array)])
    return out


def _copy_slice(pair) -> None:
    pair[0][...] = pair[1]


@functools.cache
def _copy_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="tower-copy")


def _copies(outputs: dict) -> dict[str, np.ndarray]:
    copies = {}
    for name, out in outputs.items():
        ready(outputs, name)
        copies[name] = copied(out)
    return copies
