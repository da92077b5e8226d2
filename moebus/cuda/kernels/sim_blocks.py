"""A faster block manager for numba's CUDA simulator (tests without a GPU); imported only when
NUMBA_ENABLE_CUDASIM=1, kernels never import it.

The simulator runs a block as one OS thread per CUDA thread, made for that block, and its manager
polls every thread in a loop until all are blocked in syncthreads (numba-cuda's simulator/kernel.py,
BlockManager): the threads fight over the GIL, each barrier wakes them one by one through the kernel,
and the polling loop takes its share of every switch interval. The suite's simulator tests spent more
time there than in the kernels (one routing test: 60 s wall, 27 s of it in system calls).

Here a block's CUDA threads are greenlets in the launching thread: each runs until it reaches a
barrier (syncthreads, or a warp's exchange in sim_warps.py) and hands back to the manager, which runs
the next; a barrier opens when every thread still running has reached it. No OS thread, no lock,
no GIL hand-off, and the threads always run in the same order (the atomics' order in a block no longer
depends on the OS's scheduling). The same semantics otherwise: a barrier counts the threads still
running, an exception in one thread ends the launch with the thread's and block's indices in its
message (the simulator's own form), and a warp barrier that can never open is an error, not a hang."""
from __future__ import annotations

import threading
import types

import greenlet
import numpy as np

_AT_SYNCTHREADS = object()


class SimThread(greenlet.greenlet):
    """One simulated CUDA thread: the attributes the simulator's cuda module reads (threadIdx, blockIdx,
    thread_id, syncthreads*, _manager), as numba's BlockThread has them."""

    def __init__(self, manager, target, block_index, thread_index):
        from numba.cuda.simulator.kernelapi import Dim3

        super().__init__(run=self._body)
        self._manager, self._target = manager, target
        self.blockIdx, self.threadIdx = Dim3(*block_index), Dim3(*thread_index)
        x, y, _ = manager._block_dim
        self.thread_id = thread_index[0] + x * (thread_index[1] + y * thread_index[2])
        self.waiting = None  # None: runnable; _AT_SYNCTHREADS; or a callable that says when it may go on
        self.exception = None

    def _body(self):
        try:
            self._target()
        except greenlet.GreenletExit:
            raise
        except Exception as exc:  # the simulator's message: the thread's and block's indices first
            self.exception = _located(exc, self.threadIdx, self.blockIdx)

    def syncthreads(self) -> None:
        self.waiting = _AT_SYNCTHREADS
        self.parent.switch()

    def wait_until(self, ready) -> None:
        """Hand back to the manager until ``ready()`` is true (a warp's barrier)."""
        if not ready():
            self.waiting = ready
            self.parent.switch()

    def _sync_state(self, value):
        self._manager.block_state[self.threadIdx.x, self.threadIdx.y, self.threadIdx.z] = value
        self.syncthreads()
        state = self._manager.block_state.copy()
        self.syncthreads()
        return state

    def syncthreads_count(self, value):
        return np.count_nonzero(self._sync_state(value))

    def syncthreads_and(self, value):
        return 1 if np.all(self._sync_state(value)) else 0

    def syncthreads_or(self, value):
        return 1 if np.any(self._sync_state(value)) else 0


def current():
    """The simulated CUDA thread running now, or (outside a kernel) the OS thread."""
    running = greenlet.getcurrent()
    return running if isinstance(running, SimThread) else threading.current_thread()


def _located(exc: Exception, thread_index, block_index):
    where = f"tid={list(thread_index)} ctaid={list(block_index)}"
    message = f"{where}: {exc}" if str(exc) else where
    try:
        located = type(exc)(message)
    except Exception:  # an exception type that takes other arguments: as it is
        located = exc
    return located, exc.__traceback__


class BlockManager:
    """numba's simulator BlockManager (same constructor and run), on greenlets."""

    def __init__(self, f, grid_dim, block_dim, debug):
        self._grid_dim, self._block_dim, self._f, self._debug = grid_dim, block_dim, f, debug
        self.block_state = np.zeros(block_dim, dtype=np.bool_)

    def run(self, grid_point, *args) -> None:
        f, debug = self._f, self._debug

        def target():
            if debug:  # numba's threads set it for themselves; greenlets share the launching thread's state
                with np.errstate(divide="raise"):
                    f(*args)
            else:
                f(*args)

        live = [SimThread(self, target, grid_point, point) for point in np.ndindex(*self._block_dim)]
        while live:
            ran = False
            for thread in live:
                waiting = thread.waiting
                if waiting is _AT_SYNCTHREADS or (waiting is not None and not waiting()):
                    continue
                thread.waiting = None
                thread.switch()  # until it ends or reaches a barrier
                ran = True
                if thread.exception is not None:
                    raise thread.exception[0].with_traceback(thread.exception[1])
            live = [thread for thread in live if not thread.dead]
            if live and all(thread.waiting is _AT_SYNCTHREADS for thread in live):
                for thread in live:
                    thread.waiting = None  # every thread still running is at syncthreads: it opens
            elif live and not ran:
                raise RuntimeError(f"block {grid_point}: threads wait at a warp barrier that some lane never reaches")


def install() -> None:
    """Launches made from here on run their blocks on this module's manager; the simulator's cuda module
    finds the running CUDA thread through ``current``."""
    from numba.cuda.simulator import kernel, kernelapi

    kernel.BlockManager = BlockManager
    kernelapi.threading = types.SimpleNamespace(**{name: getattr(threading, name) for name in dir(threading)
                                                   if not name.startswith("__")})
    kernelapi.threading.current_thread = current
