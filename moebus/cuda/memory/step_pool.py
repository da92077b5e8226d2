"""Per-step buffers that are all taken back at once: the backend's answer to "every op result is
valid until the next begin_step()". Raw byte buffers come in power-of-two size classes, so prefills
of many lengths share a few buffers; each buffer keeps the typed views made of it, and the i-th take
of a size class in a step gets the buffer that the i-th take had in the step before, so a steady
decode loop neither allocates nor builds array objects.

Within a step, buffers also come back per layer (mark() / recycle_since()): a layer's temporaries
are reused by the next layer, so a step holds about one layer's worth instead of one per layer.
That is safe on the device because every kernel of a step runs on one stream, in order."""
from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

MIN_BYTES = 256  # also the alignment every view starts at (wide loads need 8)
MAX_VIEWS = 16  # views cached per buffer; more shapes than this and the cache starts over


def ceil_pow2(n: int) -> int:
    """The least power of two >= ``n`` (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def size_class(nbytes: int) -> int:
    """The bytes of the buffer a take of ``nbytes`` gets: the power-of-two class, at least MIN_BYTES. What
    a scratch estimate counts per buffer (the vision towers' encode scratch; cache_sizing's loan)."""
    return max(MIN_BYTES, ceil_pow2(nbytes))


def _address(array) -> int:
    """Where an array's data starts: a device array, numba's simulator's stand-in, or numpy."""
    interface = getattr(array, "__cuda_array_interface__", None)
    if interface is not None:
        return int(interface["data"][0])
    return int(getattr(array, "_ary", array).__array_interface__["data"][0])


class _Buffer:
    def __init__(self, raw):
        self.raw = raw
        self.views = {}

    def view(self, shape: tuple, dtype: np.dtype):
        key = (shape, dtype.str)
        array = self.views.get(key)
        if array is None:
            if len(self.views) >= MAX_VIEWS:
                self.views.clear()
            nbytes = math.prod(shape) * dtype.itemsize
            array = self.views[key] = self.raw[:nbytes].view(dtype).reshape(shape)
        return array


class StepPool:
    def __init__(self, allocate):
        """``allocate(shape, dtype)``: a new C-contiguous array (device or pinned host)."""
        self._allocate = allocate
        self._free: dict[int, list[_Buffer]] = defaultdict(list)
        self._used: list[tuple[int, _Buffer]] = []
        self._loan = None  # a byte region lent for this step (the prompt-path loan), carved in order
        self._loan_used = 0
        self._loaned: set[int] = set()  # ids of buffers that live in the loan
        self.allocated_bytes = 0  # held by this pool's own buffers (loaned ones live in the arena)
        self.beyond_loan_bytes = 0  # of those, allocated while a loan was lent and short (not in the budget)
        self.peak_bytes = 0  # the most allocated_bytes has been since reset_peak()

    def take(self, shape, dtype):
        """An uninitialised C-contiguous array, valid until recycle()."""
        shape, dtype = tuple(int(s) for s in shape), np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return self._allocate(shape, dtype)
        size = size_class(nbytes)
        free = self._free[size]
        buffer = free.pop() if free else self._from_loan(size) or self._new(size)
        self._used.append((size, buffer))
        return buffer.view(shape, dtype)

    def _new(self, size: int) -> _Buffer:
        buffer = _Buffer(self._allocate((size,), np.uint8))
        self.allocated_bytes += size
        self.beyond_loan_bytes += size if self._loan is not None else 0
        self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        return buffer

    def reset_peak(self) -> None:
        """Start measuring: peak_bytes is what the pool holds now, and grows with what it allocates."""
        self.peak_bytes = self.allocated_bytes

    def _from_loan(self, size: int) -> _Buffer | None:
        if self._loan is None or self._loan_used + size > len(self._loan):
            return None
        buffer = _Buffer(self._loan[self._loan_used : self._loan_used + size])
        self._loan_used += size  # sizes are powers of two >= MIN_BYTES: offsets stay aligned
        self._loaned.add(id(buffer))
        return buffer

    def lend(self, region) -> None:
        """Serve new buffers from ``region`` (1-D uint8) until end_loan(): a long prefill's scratch
        comes out of memory the expert cache lent, instead of new allocations."""
        self._loan, self._loan_used = region, 0

    def end_loan(self) -> None:
        """Forget every buffer in the lent region; the caller has synchronised, so none is in use."""
        if self._loan is None:
            return
        self._free = defaultdict(list, {size: [b for b in buffers if id(b) not in self._loaned]
                                        for size, buffers in self._free.items()})
        self._used = [(size, b) for size, b in self._used if id(b) not in self._loaned]
        self._loan, self._loan_used, self._loaned = None, 0, set()

    def mark(self) -> int:
        """A point in this step's takes, for recycle_since()."""
        return len(self._used)

    def recycle_since(self, mark: int, keep=()) -> None:
        """Buffers taken since ``mark`` may be handed out again, except those holding an array of
        ``keep`` (what the next layer still reads: the residual stream)."""
        live = [_address(a) for a in keep if a is not None and getattr(a, "size", 1)]
        kept = []
        for size, buffer in reversed(self._used[mark:]):  # pop() then returns them in take order
            start = _address(buffer.raw)
            if any(start <= at < start + size for at in live):
                kept.append((size, buffer))
            else:
                self._free[size].append(buffer)
        del self._used[mark:]
        self._used.extend(reversed(kept))

    def recycle(self) -> None:
        """Every array handed out so far may be handed out again."""
        for size, buffer in reversed(self._used):  # pop() then returns them in this step's order
            self._free[size].append(buffer)
        self._used.clear()

    def release(self) -> None:
        """Drop the free buffers (memory goes back once nothing else holds them)."""
        self.allocated_bytes -= sum(size * len(buffers) for size, buffers in self._free.items())
        self._free.clear()

    @property
    def cached_bytes(self) -> int:
        return sum(size * len(buffers) for size, buffers in self._free.items()) + sum(s for s, _ in self._used)
