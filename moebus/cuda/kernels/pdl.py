"""Programmatic dependent launch (PDL, Hopper: PTX ISA 7.8, sm_90) inside a captured decode graph.

A decode step is ~480 small dependent kernels; at every boundary the GPU drains one kernel, launches
the next and ramps it up. With a *programmatic* edge between two kernel nodes of a graph the
dependent kernel's blocks may start while its predecessor still runs; they block in
``griddepcontrol.wait`` until the predecessor has completed and its writes are visible. So:

- ``grid_dependency_wait()``: PTX ``griddepcontrol.wait`` (a no-op in a launch without a programmatic
  dependency, and in the simulator). A kernel that calls it **first**, before any global read or
  write, is safe behind a programmatic edge. Called first in every block, not after an early return:
  a kernel whose blocks all returned without waiting would complete before its predecessor does and
  let its own dependents run too early.
- ``launch_dependents()``: PTX ``griddepcontrol.launch_dependents``: this block lets the dependents
  launch (with edges from the PROGRAMMATIC port; without it the port fires as each block ends).
- ``prefetch_rows(array, first_row, rows, num_rows, begin, end, line_words)``: the calling warp asks L2
  for words [begin, end) of a few rows (``prefetch.global.L2``, one request a 128-byte line): a GEMV
  issues its weights' first rows so before it waits (weights never change within a step), and their
  bytes come from HBM while the predecessor ends.
- ``released_early()``: whether a kernel may read, before its wait, what the kernel two before it
  wrote: only with edges from the PROGRAMMATIC port and a predecessor that calls launch_dependents
  after its own wait (moe_ffn's gate|up: the down GEMV then reads the routing's slots and prefetches
  its experts' first rows before it waits).
- ``waiting_functions()``: the CUfunction handles (and entry names) of every compiled kernel whose
  Python source calls ``grid_dependency_wait`` (compat._KERNELS is the registry of every kernel defined).
- ``plan_edges`` (pure Python, tested in the simulator) and ``make_programmatic`` (the driver calls):
  each kernel -> kernel edge of a captured graph whose destination waits becomes a programmatic
  edge; edges from or to other nodes (copies, memsets) and into kernels that do not wait (cuBLAS,
  NVRTC, numba kernels without the call) keep their full dependency, and so does a join (a node
  with more than one edge in: the side branch's, graphs.SideBranch).

``MOEBUS_PDL``: 0 off, ``programmatic`` (1; the default) or ``launch_order``, the port the
edges leave from. ``launch_order``: the dependent may start once all the predecessor's blocks have
started; ``programmatic``: once each has called launch_dependents or ended.

``MOEBUS_PDL_TRIGGER`` (read when this module is imported; part of kernel_cache's fingerprint, since
it changes the compiled code; 1 by default, 0 off): 1 makes ``grid_dependency_wait`` also call launch_dependents right
after the wait, in every kernel: with the PROGRAMMATIC port the next kernel's blocks then launch
while this one computes and sit in their own wait (at most one kernel ahead: a kernel releases its
dependent only once its own wait has passed, i.e. once the kernel before it has completed, which is
the rule ``released_early`` relies on). Without a programmatic edge the trigger does nothing.

A graph the driver will not edit keeps its plain edges: cuGraphRemoveDependencies refuses graphs
with memory allocation or free nodes (CUDA_ERROR_NOT_SUPPORTED; cuBLAS made them with
cudaMallocAsync for its workspace until gemm_host gave each handle its own), so such a graph is
left as captured (``refused`` in the counts, logged once), and an edge the driver refuses to add
back is restored as a plain edge."""
from __future__ import annotations

import logging
import os

from moebus.cuda.kernels import kernel_cache
from moebus.cuda.kernels.compat import SIMULATOR, WARP, cuda, device

ENV = "MOEBUS_PDL"
DEFAULT = "programmatic"  # with the trigger: b1 301.4 vs 295.4 tok/s, graph == eager (docs/performance.md, 13th session)
PORTS = ("programmatic", "launch_order")
WAIT_NAME = "grid_dependency_wait"
TRIGGER_ENV = "MOEBUS_PDL_TRIGGER"
log = logging.getLogger("moebus.cuda.pdl")
_logged: set[str] = set()


def trigger_after_wait() -> bool:
    """MOEBUS_PDL_TRIGGER: every kernel releases its dependent right after its wait (compiled in)."""
    return kernel_cache.compile_switch(TRIGGER_ENV)


def mode() -> str | None:
    """The port programmatic edges leave from, or None (PDL off), from MOEBUS_PDL."""
    value = os.environ.get(ENV, DEFAULT).strip().lower()
    if value in ("", "0", "off", "false", "no"):
        return None
    if value in ("1", "on", "true", "yes"):
        return "programmatic"
    if value not in PORTS:
        raise ValueError(f"{ENV}={value!r}: expected 0, 1, {' or '.join(PORTS)}")
    return value


if not SIMULATOR:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    def _statement(ptx: str):
        @intrinsic
        def statement(typingctx):
            def codegen(context, builder, sig, args):
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), ptx, "~{memory}", side_effect=True)
                builder.call(asm, [])
                return context.get_dummy_value()

            return types.void(), codegen

        return statement

    grid_dependency_wait = _statement("griddepcontrol.wait; griddepcontrol.launch_dependents;"
                                      if trigger_after_wait() else "griddepcontrol.wait;")
    launch_dependents = _statement("griddepcontrol.launch_dependents;")

    @intrinsic
    def prefetch_l2(typingctx, array, row, at):
        """Prefetch the L2 line holding array[row, at] (a C-ordered 2-D array; no wraparound)."""
        from numba.cuda import cgutils

        def codegen(context, builder, sig, args):
            array_type = sig.args[0]
            indices = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], sig.args[1:])]
            pointer = cgutils.get_item_pointer(context, builder, array_type,
                                               context.make_array(array_type)(context, builder, value=args[0]),
                                               indices, wraparound=False)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [pointer.type]), "prefetch.global.L2 [$0];", "l",
                               side_effect=True)
            builder.call(asm, [pointer])
            return context.get_dummy_value()

        return types.void(array, row, at), codegen
else:
    def grid_dependency_wait():
        pass

    def launch_dependents():
        pass

    def prefetch_l2(array, row, at):
        pass


@device
def prefetch_span(array, row, begin, end, line_words):
    """L2 prefetch by the calling warp of array[row, begin:end]; ``line_words``: the array's elements
    in 128 bytes."""
    lane = cuda.threadIdx.x % WARP
    for word in range(begin + lane * line_words, end + line_words - 1, WARP * line_words):
        prefetch_l2(array, row, min(word, end - 1))


@device
def prefetch_rows(array, first_row, rows, num_rows, begin, end, line_words):
    """prefetch_span of array[first_row + r, begin:end] for r < rows (rows past num_rows - 1 clamped
    to it)."""
    for r in range(rows):
        prefetch_span(array, min(first_row + r, num_rows - 1), begin, end, line_words)


def released_early() -> bool:
    """Edges leave from the PROGRAMMATIC port (see the module's docstring)."""
    return mode() == "programmatic"


def waits(py_func) -> bool:
    """Whether a kernel's Python function calls grid_dependency_wait."""
    code = getattr(py_func, "__code__", None)
    return code is not None and WAIT_NAME in code.co_names


_REGISTERED: set = set()  # handles (ints) and entry names (bytes) of kernels built elsewhere that wait (NVRTC)


def register_waiting(*functions) -> None:
    """Marks kernels not defined through compat (NVRTC's: attention_decode_tc with TC_PDL) as waiting first
    in every block, by handle (int) or entry name (bytes): waiting_functions includes them."""
    _REGISTERED.update(functions)


def waiting_functions() -> set:
    """CUfunction handles (ints) and entry names (bytes) of every compiled variant of every kernel
    that waits: a graph's kernel node names its function by handle, or else by its name."""
    from moebus.cuda.kernels import compat

    found = set(_REGISTERED)
    for dispatcher in compat._KERNELS:
        if not waits(getattr(dispatcher, "py_func", None)):
            continue
        for compiled in getattr(dispatcher, "overloads", {}).values():
            function = compiled._codelibrary.get_cufunc()
            found.add(int(getattr(function.handle, "value", function.handle)))
            name = getattr(function, "name", None)
            if name:
                found.add(name.encode() if isinstance(name, str) else bytes(name))
    return found


def plan_edges(edges, kernel_function: dict, waiting: set) -> list[int]:
    """Indices of the edges to make programmatic. ``edges``: (from, to) node keys; ``kernel_function``:
    node key -> function handle, for kernel nodes only; ``waiting``: handles of kernels that wait.
    An edge qualifies when both ends are kernel nodes, the destination's kernel waits and the edge is
    the destination's only one in (a join of two branches keeps its full edges)."""
    into = {}
    for _, dst in edges:
        into[dst] = into.get(dst, 0) + 1
    return [i for i, (src, dst) in enumerate(edges)
            if src in kernel_function and kernel_function.get(dst) in waiting and into[dst] == 1]


def _driver(name: str):
    from cuda.bindings import driver as cu

    return getattr(cu, name + "_v2", None) or getattr(cu, name)  # cuda.bindings 12.x names the edge-data forms _v2


def _check(result, what: str):
    from cuda.bindings import driver as cu

    status = result[0] if isinstance(result, tuple) else result
    if status != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"PDL: {what}: {status}")
    return result


REFUSING_NODE_TYPES = ("CU_GRAPH_NODE_TYPE_MEM_ALLOC", "CU_GRAPH_NODE_TYPE_MEM_FREE")


def refusal(node_types: dict[str, int]) -> str | None:
    """Why the driver will not edit a graph's edges (None: it will), from its nodes' types by name:
    cuGraphRemoveDependencies refuses graphs with memory allocation or free nodes."""
    found = {t: n for t, n in node_types.items() if t in REFUSING_NODE_TYPES and n}
    return None if not found else "graph has " + ", ".join(f"{n} {t.rsplit('_', 2)[-2].lower()} "
                                                          f"{t.rsplit('_', 1)[-1].lower()} nodes"
                                                          for t, n in sorted(found.items()))


def _note_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        log.warning("PDL: a decode graph keeps its plain edges: %s", reason)


def make_programmatic(graph, port: str = "programmatic") -> dict:
    """Turn each qualifying kernel -> kernel edge of ``graph`` (a CUgraph, not yet instantiated) into
    a programmatic one leaving from ``port``. Returns counts: nodes, kernel nodes, waiting kernel
    nodes, edges, converted, and ``refused`` (why nothing was converted, where the driver would not:
    the graph then keeps every edge it was captured with) and ``types`` (its other nodes by type).
    Never leaves the graph with an edge less than it had: a failed add restores the plain edges."""
    from cuda.bindings import driver as cu

    _, src, dst, *rest = _check(_driver("cuGraphGetEdges")(graph, 0), "count edges")
    count = rest[-1]
    _, src, dst, *rest = _check(_driver("cuGraphGetEdges")(graph, count), "edges")
    old_data = rest[0] if len(rest) == 2 else None
    _, nodes, num_nodes = _check(cu.cuGraphGetNodes(graph, 0), "count nodes")
    _, nodes, num_nodes = _check(cu.cuGraphGetNodes(graph, num_nodes), "nodes")
    waiting = waiting_functions()
    functions, types, alloc_bytes = {}, {}, {}
    for node in nodes:
        (_, kind) = _check(cu.cuGraphNodeGetType(node), "node type")
        if kind != cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            name = getattr(kind, "name", str(kind))
            types[name] = types.get(name, 0) + 1
            if kind == cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_MEM_ALLOC:  # its size: who allocated it
                try:
                    status, params = cu.cuGraphMemAllocNodeGetParams(node)
                    size = int(params.bytesize) if status == cu.CUresult.CUDA_SUCCESS else -1
                except Exception:  # noqa: BLE001 - only a figure for the log line: never fail the capture
                    size = -1
                alloc_bytes[size] = alloc_bytes.get(size, 0) + 1
            continue
        status, params = cu.cuGraphKernelNodeGetParams(node)
        function = int(params.func) if status == cu.CUresult.CUDA_SUCCESS else 0
        if function and function not in waiting:
            status, name = cu.cuFuncGetName(params.func)
            function = name if status == cu.CUresult.CUDA_SUCCESS and name in waiting else function
        functions[int(node)] = function  # 0: a kernel node whose function is unknown (never waits)
    chosen = plan_edges([(int(a), int(b)) for a, b in zip(src, dst)], functions, waiting)
    stats = {"nodes": int(num_nodes), "kernels": len(functions),
             "waiting": sum(f in waiting for f in functions.values()), "edges": int(count), "converted": 0,
             "types": types}
    if not chosen:
        return stats
    reason = refusal(types)
    if reason is not None and alloc_bytes:
        stats["alloc_bytes"] = alloc_bytes
        reason += " (bytes: count " + ", ".join(f"{b}: {n}" for b, n in sorted(alloc_bytes.items())) + ")"
    if reason is None and old_data is not None and \
            any(int(old_data[i].type) != 0 or int(old_data[i].from_port) != 0 for i in chosen):
        reason = "the captured graph already has non-default edges"
    froms, tos = [src[i] for i in chosen], [dst[i] for i in chosen]
    remove, add = _driver("cuGraphRemoveDependencies"), _driver("cuGraphAddDependencies")
    if reason is None:
        status = remove(graph, froms, tos, [cu.CUgraphEdgeData() for _ in chosen], len(chosen))
        status = status[0] if isinstance(status, tuple) else status
        if status != cu.CUresult.CUDA_SUCCESS:  # nothing removed: the driver checks before it edits
            reason = f"remove edges: {status}"
    if reason is not None:
        stats["refused"] = reason
        _note_once(reason)
        return stats
    edge = []
    for _ in chosen:
        data = cu.CUgraphEdgeData()
        data.type = cu.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
        data.from_port = (cu.CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER if port == "launch_order"
                          else cu.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC)
        edge.append(data)
    status = add(graph, froms, tos, edge, len(chosen))
    status = status[0] if isinstance(status, tuple) else status
    if status != cu.CUresult.CUDA_SUCCESS:  # put the plain edges back, as captured
        _check(add(graph, froms, tos, [cu.CUgraphEdgeData() for _ in chosen], len(chosen)), "restore edges")
        stats["refused"] = f"add programmatic edges: {status}"
        _note_once(stats["refused"])
        return stats
    stats["converted"] = len(chosen)
    return stats
