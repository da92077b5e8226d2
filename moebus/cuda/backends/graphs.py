"""A forward pass captured once as a CUDA graph and replayed: every launch of a decode step costs
~1 us inside a graph instead of ~30 us from Python.

``CapturedStep(backend, host_inputs, run)`` lays the step's inputs out in one packed device buffer
(one host->device copy per replay), runs ``run(inputs)`` once eagerly with a private scratch pool
(compiles kernels, allocates every buffer, and does the step's real work), recycles that pool and
runs ``run`` again while numba launches into a ``cuda.core`` GraphBuilder, so each launch finds the
same buffers it had in the eager run. The graph then owns those buffers for its life; ``replay``
writes new inputs, launches the graph and copies the named outputs back, syncing once.

``run`` must enqueue kernels only (no host copy, sync or data-dependent host logic) and take the
same code path for the same input shapes. It may fork a second branch (``SideBranch``: the expert
prefetch, workers/prefetch.py) and must join it before it returns. Not available under numba's
simulator.

With ``MOEBUS_PDL`` on (kernels/pdl.py), each kernel -> kernel edge of the captured graph whose
destination calls ``grid_dependency_wait`` first becomes a programmatic edge before the graph is
instantiated: the dependent's blocks launch while its predecessor ends (``CapturedStep.pdl`` holds
the counts). A graph the driver will not edit (memory alloc / free nodes) keeps its plain edges and
is still replayed as a graph: PDL never sends a step back to eager launches."""
from __future__ import annotations

import contextlib

import numpy as np

from moebus.cuda.kernels import pdl
from moebus.cuda.kernels.compat import SIMULATOR, cuda
from moebus.cuda.memory.step_pool import MIN_BYTES, StepPool


def graphs_available() -> bool:
    return not SIMULATOR


def _core_stream(numba_stream):
    try:
        from cuda.core import Stream
    except ImportError:  # cuda.core < 1.0
        from cuda.core.experimental import Stream
    return Stream.from_handle(int(numba_stream.__cuda_stream__()[1]))


def _layout(host_inputs: dict) -> tuple[dict, int]:
    offsets, total = {}, 0
    for name, array in host_inputs.items():
        offsets[name] = total
        total += -(-max(array.nbytes, 1) // MIN_BYTES) * MIN_BYTES  # aligned for wide reads
    return offsets, total


def shared_pool() -> StepPool:
    """One scratch pool for all the decode graphs of a stage: graphs replay one at a time on one
    stream, so they may share buffers (the memory of the largest step, not of the sum of steps). Its
    buffers are never released: a graph keeps raw pointers into them for its life."""
    return StepPool(lambda shape, dtype: cuda.device_array(shape, dtype=dtype))


class CapturedStep:
    def __init__(self, backend, host_inputs: dict[str, np.ndarray], run, pool: StepPool | None = None):
        """``pool``: a shared_pool() (None: a private pool, released with the graph)."""
        self.backend = backend
        self.shared_pool = pool is not None
        self.specs = {name: (a.shape, a.dtype) for name, a in host_inputs.items()}
        self.offsets, total = _layout(host_inputs)
        self.staging = cuda.pinned_array(total, np.uint8)
        self.packed = cuda.device_array(total, np.uint8)
        self.inputs = {name: self._view(self.packed, name) for name in self.specs}
        self.host_views = {name: self._view(self.staging, name) for name in self.specs}
        self.pool = pool or StepPool(lambda shape, dtype: cuda.device_array(shape, dtype=dtype))
        self.stream = _core_stream(backend.stream)
        with backend.private_pool(self.pool):
            self.pool.recycle()  # a shared pool: the other graphs' buffers serve this one too
            self._upload(host_inputs)
            run(self.inputs)
            backend.synchronize()
            self.pool.recycle()
            self.outputs, self.graph = self._capture(run)
        self.host_outputs = {name: cuda.pinned_array(a.shape, a.dtype) for name, a in self.outputs.items()}
        self.launches: list[Launch] | None = None  # launch()'s buffers, made on first use

    def _view(self, buffer, name: str):
        shape, dtype = self.specs[name]
        offset = self.offsets[name]
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        return buffer[offset : offset + nbytes].view(dtype).reshape(shape)

    def _capture(self, run):
        builder = self.stream.create_graph_builder()
        try:
            builder = builder.begin_building("relaxed")  # launches from numba may touch the allocator
        except TypeError:
            builder = builder.begin_building()
        port, graph, failed = pdl.mode(), None, False
        try:
            with self.backend.capturing(builder):
                outputs = run(self.inputs)
            if port is not None:
                graph = _captured_graph(builder)
        except BaseException:
            failed = True
            raise
        finally:
            try:
                builder = builder.end_building()
            except Exception:  # an invalidated capture: the builder may leave the stream capturing
                end_capture(self.stream)
                if not failed:
                    raise  # (else the launch's own error, which invalidated it, is the one to read)
        self.pdl = pdl.make_programmatic(graph, port) if port is not None else None
        return outputs, builder.complete()

    def _upload(self, host_inputs: dict) -> None:
        for name, view in self.host_views.items():
            view[...] = host_inputs[name]
        self.packed.copy_to_device(self.staging, stream=self.backend.stream)

    def matches(self, host_inputs: dict) -> bool:
        return all(self.specs.get(n) == (a.shape, a.dtype) for n, a in host_inputs.items()) and \
            len(host_inputs) == len(self.specs)

    def replay(self, host_inputs: dict, names=None) -> dict[str, np.ndarray]:
        """Run the captured step on new inputs; returns copies of the outputs in ``names`` (all)."""
        stream = self.backend.stream
        self._upload(host_inputs)
        self.graph.launch(self.stream)
        names = list(self.outputs) if names is None else names
        for name in names:
            self.outputs[name].copy_to_host(self.host_outputs[name], stream=stream)
        stream.synchronize()
        return {name: np.array(self.host_outputs[name]) for name in names}

    def launch(self, host_inputs: dict, names, tokens=None) -> "Launch":
        """``replay`` without the wait, for a step launched while the one before it still runs: its
        own pinned buffers (two in turn, so the step before keeps its outputs until collected), and
        ``tokens`` (a device array: the ids the previous step sampled) copied over the ``tokens``
        input in stream order. At most two launches may be uncollected at a time."""
        if self.launches is None or self.launches[0].names != list(names):
            self.launches = [Launch(self, names), Launch(self, names)]
        launch = self.launches[0]
        self.launches.reverse()
        stream = self.backend.stream
        for name, view in launch.staging_views.items():
            view[...] = host_inputs[name]
        self.packed.copy_to_device(launch.staging, stream=stream)
        if tokens is not None:
            self.inputs["tokens"].copy_to_device(tokens, stream=stream)
        self.graph.launch(self.stream)
        for name in launch.names:
            self.outputs[name].copy_to_host(launch.host_outputs[name], stream=stream)
        launch.done.record(stream)
        return launch

    def close(self) -> None:
        self.graph.close()
        if not self.shared_pool:
            self.pool.release()


class SideBranch:
    """A second stream that forks from the compute stream and joins it again, eagerly or while the
    compute stream is being captured: an event recorded on the capturing stream and waited on by the
    side stream pulls the side stream into the graph as a parallel branch, and the join's event
    brings it back (a capture must end with every branch joined). Under the simulator every launch
    runs to completion at once, so there is nothing to order."""

    def __init__(self):
        self.stream = cuda.stream()
        self.forks = 0  # forks not yet joined: at most one
        if not SIMULATOR:
            self._forked, self._joined = cuda.event(timing=False), cuda.event(timing=False)

    def fork(self, main) -> None:
        """Work launched on ``self.stream`` from now on runs after what ``main`` has so far."""
        assert self.forks == 0, "fork while a branch is open"
        self.forks = 1
        if not SIMULATOR:
            _record_and_wait(self._forked, main, self.stream)

    def join(self, main) -> None:
        """Work launched on ``main`` from now on runs after the side branch's."""
        assert self.forks == 1, "join without a fork"
        self.forks = 0
        if not SIMULATOR:
            _record_and_wait(self._joined, self.stream, main)


def _captured_graph(builder):
    """The CUgraph a GraphBuilder is capturing into (still building): the same graph end_building
    keeps and complete() instantiates."""
    from cuda.bindings import driver as cu

    result = cu.cuStreamGetCaptureInfo(_stream_handle(builder))
    if result[0] != cu.CUresult.CUDA_SUCCESS or result[1] != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
        raise RuntimeError(f"PDL: no capture on the graph builder's stream: {result[:2]}")
    return result[3]


def end_capture(stream) -> None:
    """End a capture still open on ``stream`` (one a failed launch invalidated: the stream refuses
    every other call until it ends), dropping what it recorded; nothing where none is open."""
    from cuda.bindings import driver as cu

    handle = _stream_handle(stream)
    status = cu.cuStreamIsCapturing(handle)
    if status[0] != cu.CUresult.CUDA_SUCCESS or status[1] == cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE:
        return
    result = cu.cuStreamEndCapture(handle)  # (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, and the capture ended)
    if result[0] == cu.CUresult.CUDA_SUCCESS and result[1]:
        cu.cuGraphDestroy(result[1])


def _stream_handle(stream) -> int:
    return int(stream.__cuda_stream__()[1])  # a numba Stream or a cuda.core GraphBuilder


def _record_and_wait(event, recorder, waiter) -> None:
    from cuda.bindings import driver as cu

    handle = int(getattr(event.handle, "value", event.handle))  # a bindings CUevent, or a ctypes handle
    for result in (cu.cuEventRecord(handle, _stream_handle(recorder)),
                   cu.cuStreamWaitEvent(_stream_handle(waiter), handle, 0)):
        if result[0] != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"fork/join of the side branch: {result[0]}")


@contextlib.contextmanager
def swapped(obj, **values):
    """Set attributes of ``obj`` for the duration of a block."""
    old = {name: getattr(obj, name) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield obj
    finally:
        for name, value in old.items():
            setattr(obj, name, value)


class Launch:
    """One launched replay's pinned buffers and its completion event (CapturedStep.launch)."""

    def __init__(self, step: CapturedStep, names):
        self.names = list(names)
        self.staging = cuda.pinned_array(step.staging.shape, np.uint8)
        self.staging_views = {name: step._view(self.staging, name) for name in step.specs}
        self.host_outputs = {name: cuda.pinned_array(step.outputs[name].shape, step.outputs[name].dtype)
                             for name in self.names}
        self.done = cuda.event(timing=False)

    def is_done(self) -> bool:
        """Has the step finished (or failed: collect then raises)? Asked of the driver directly:
        numba's Event.query logs every not-ready answer as an ERROR."""
        from cuda.bindings import driver as cu

        (status,) = cu.cuEventQuery(int(self.done.handle))
        return status != cu.CUresult.CUDA_ERROR_NOT_READY

    def collect(self) -> dict[str, np.ndarray]:
        """Wait for the step; copies of its outputs."""
        self.done.synchronize()
        return {name: np.array(array) for name, array in self.host_outputs.items()}
