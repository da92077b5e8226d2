"""The elastic expert cache: pure bookkeeping over an arena. Tables map (layer, expert) keys to
slots and back; a policy keeps recency; the experts of the group being computed are pinned (a
pinned expert is never evicted or moved). Misses are copied from the host store into free or
evicted slots by a copier (synchronous on cpu, a copy stream on cuda).

VRAM requests resize the arena by whole segments: ``resize(r)`` empties and releases tail segments
until at least r MiB are free on the device (at least one segment when anything is missing), or
grows again while r allows; ``resize(None)`` (bare) maps every start-up segment again.

The decode path does not ask the cache between layers: a *placement table* (layer row, expert) ->
slot, or ``-1 - key`` for an expert read from the host store (routing.py), travels to the device
and the kernels follow it. After each step ``observe`` learns the step's choices, and misses the
policy deems worth a slot are copied in (on cuda, on the copy stream while later steps run); an
entry points at a slot only once its copy is complete, and stops pointing at it before the slot is
reused, shrunk away or lent out.

A prefill's groups (``acquire``/``release`` a layer, or a part of one, at a time) chain their copies
where the copier has per-slot fences (cuda's StreamCopier): a missed expert's copy waits only for the
release of the group that last read the slot it overwrites (or, for a slot no group of this pass read,
for the compute stream as it was at the pass's first acquire), not for all the work enqueued so far,
so layer L's copies run beside layers L-1 and L-2's attention and experts. Victims then come
farthest-next-use first (a prefill reads every layer in order, so the expert read longest ago is the
next one needed): the slots of groups released two or more groups ago (the policy's weakest, among
equals the latest release: decode's hot experts stay); then slots
no group of this pass has read, the layer farthest ahead first; the last group's slots last (their
copies wait for its kernels). A prefill larger than the cache then keeps most of the cache resident
from pass to pass and cycles a few layers' worth of slots, where least-recently-used victims missed
every expert every pass. ``MOEBUS_PREFILL_COPY_FENCE=all`` (the fence behind all the work, the
policy's victims) is the previous behaviour, for comparison.

With a prefetch (workers/prefetch.py) the first ``num_reserved`` slots are its banks: never free,
never an admission's or a preload's; only a prefill group that finds every other slot pinned borrows
one, until ``release``. The prefetch's wasted copies count in ``h2d_bytes``."""
from __future__ import annotations

import os
import time

import numpy as np

from moebus.common.env_switches import number_from_env
from moebus.cuda.memory.ledger import MIB
from moebus.cuda.kernels.routing import host_placement
from moebus.workers.copy_chain import EMPTY, Chain, copy_runs
from moebus.workers.eviction import make_policy
from moebus.workers.placement_upload import PlacementUploads

# a prefill's copies: "slot" (per-slot fences, farthest-next-use victims), "slot-policy" (per-slot
# fences, the policy's victims sparing the last group's slots), "all" (wait for all the work so far)
COPY_FENCES = ("slot", "slot-policy", "all")
COPY_FENCE = os.environ.get("MOEBUS_PREFILL_COPY_FENCE", "slot")
# routed steps of up to this many tokens read their experts on the GEMV kernels, not in tiles on
# tensor cores, where the cache cannot hold every expert (``decode_tiles``): on an H200 (16 x 32
# A3B-shaped, 25% cache, batch 8) cuBLAS's tiles read the mapped host store at ~39 GB/s, the GEMVs and
# the prefetch's copies at ~50 (docs/performance.md, tenth session). Measured at 8 tokens only; more
# tokens keep the tiles (more arithmetic a missed expert). 0: tiles wherever they apply
MISSES_IN_GEMVS_UP_TO = int(os.environ.get("MOEBUS_DECODE_MISSES_IN_GEMVS_UP_TO", "8"))


# A decode step's admissions are copied over the PCIe link while the next steps read their misses over it in
# place, so a step that misses far more than usual (the text's working set moving on, a cache made smaller
# for an image) and admits up to its cap as well makes the slowest steps slower twice over (H200, 8 x 128
# LLaVA at 8 GiB through a cold image: 50 misses and ~25 admissions, 700 MiB and 15 ms a step against ~20 and
# 6 ms; docs/performance.md, twenty-fifth session). So a step admits at most what keeps its misses plus
# admissions within ADMISSION_PEAK x the typical step's misses (a running mean over ~32 steps), and at least
# ADMISSION_FLOOR: the cache keeps adapting, the admissions a shift needs wait for steps with room.
ADMISSION_FLOOR = 2
TYPICAL_MISSES_STEPS = 32


def admission_peak_from_env(environ=os.environ) -> float:
    """``MOEBUS_ADMISSION_PEAK`` (default 2; 0: off, only ``max_admissions`` caps a step's admissions): a
    number >= 0, else a ConfigError naming it, raised where a cache is built (a worker's start)."""
    return number_from_env("MOEBUS_ADMISSION_PEAK", "2", "0: off", environ)


class CacheTooSmall(RuntimeError):
    pass


class SyncCopier:
    """Copies on the calling thread (the cpu device): every copy is complete when it returns."""

    def __init__(self, arena):
        self.arena = arena

    fences = False  # copies complete at once: nothing to chain

    def copy(self, slot: int, blob, after=None) -> bool:
        self.arena.write(slot, blob)
        return True

    def wait(self) -> None:
        pass

    def is_done(self) -> bool:
        return True

    def sync(self) -> None:
        pass

    def mark(self) -> None:
        pass

    def move(self, src: int, dst: int) -> None:
        self.arena.array[dst] = self.arena.array[src]


class ExpertCache:
    def __init__(self, store, arena, copier=None, policy="freq", startup_reserve_mib: float = 0.0,
                 min_slots: int = 1, max_admissions: int | None = None, prefetch=None):
        """``prefetch``: a workers.prefetch.Prefetch whose banks are the first slots (None: none);
        ``min_slots`` must then cover them as well as an expert group."""
        self.store = store
        self.arena = arena
        self.copier = copier or SyncCopier(arena)
        num_keys = len(store.blobs)
        self.policy = make_policy(policy, num_keys) if isinstance(policy, str) else policy
        # where each expert is now, as the kernels see it: a slot, or host_placement(key)
        self.placement = np.array([host_placement(k) for k in range(num_keys)], np.int32).reshape(-1, store.num_experts)
        self._flat_placement = self.placement.reshape(-1)
        self._placement_dirty = True
        self._device_placement = None
        self._uploads = None  # the table's uploads from buffers of their own (placement_upload.py)
        self.pending: dict[int, int] = {}  # key -> slot: copy in flight, placement still on the host
        # misses copied in per step at most: admission costs PCIe time that the step's reads need too
        self.max_admissions = max_admissions if max_admissions is not None else max(1, arena.max_slots // 16)
        self.admission_peak = admission_peak_from_env()  # see ADMISSION_FLOOR
        self.typical_misses: float | None = None  # a decode step's, a running mean (None: no step yet)
        self.min_slots = min_slots
        self.startup_reserve_mib = self.reserve_mib = startup_reserve_mib
        self.slot_key = np.full(arena.max_slots, EMPTY, dtype=np.int64)
        self.key_slot: dict[int, int] = {}
        self.prefetch = prefetch
        self.num_reserved = prefetch.num_reserved if prefetch is not None else 0
        assert self.num_reserved == 0 or min_slots > self.num_reserved, "shrinks and loans must keep the banks"
        self.free: list[int] = list(range(self.num_reserved, arena.num_slots))[::-1]
        self.pinned: set[int] = set()
        self.loaned_from: int | None = None  # slots from here on are lent out as step scratch
        self.hits = self.misses = self.h2d_bytes = 0
        self.key_hits = np.zeros(num_keys, np.int64)  # hits of resident keys since their admission (the dashboard's map)
        self.trace: list | None = None  # a list: every routed step's choices are appended (bench cache)
        self.last_resize: dict = {}  # the last resize's split: admissions_wait_s, segments (mapped minus unmapped)
        self.copy_fence = COPY_FENCE  # see COPY_FENCES; read at each acquire (a benchmark may switch it)
        if self.copy_fence not in COPY_FENCES:
            raise ValueError(f"MOEBUS_PREFILL_COPY_FENCE must be one of {', '.join(COPY_FENCES)}, "
                             f"got {self.copy_fence!r}")
        self._chain: Chain | None = None  # this pass's groups, while their copies chain (see the module doc)
        self.timeline: list | None = None  # a list: each group's host times and events (tools/device/prefill9_*)
        self._copy_events = None  # the group's copy-stream events, for the timeline

    @property
    def array(self):
        """The arena as the kernels see it: (max_slots, blob elements)."""
        return self.arena.array

    @property
    def num_slots(self) -> int:
        """Slots in service: mapped, and not lent to a prefill."""
        mapped = self.arena.num_slots
        return mapped if self.loaned_from is None else min(mapped, self.loaned_from)

    @property
    def not_resident(self) -> int:
        """How many of the stage's experts no slot holds (0: every one is resident, nothing is ever
        copied in or evicted; a spanning chunk and a decode step launched ahead ask this)."""
        return len(self.store.layers) * self.store.num_experts - len(self.key_slot)

    def decode_tiles(self, num_tokens: int) -> bool:
        """May a routed step of ``num_tokens`` run its experts in tiles on tensor cores? Not where
        misses are read in place (a cache that cannot hold every expert) by a step of at most
        MISSES_IN_GEMVS_UP_TO tokens."""
        return num_tokens > MISSES_IN_GEMVS_UP_TO or self.num_slots - self.num_reserved >= len(self.store.blobs)

    # -- the prompt-path loan ---------------------------------------------------------------------

    def lend(self, num_bytes: int) -> tuple[int, int]:
        """Lend tail slots to a long prefill as scratch; returns the lent slot range [lo, hi).
        At least ``min_slots`` stay in service. The loan is computed against the cache as it is
        now, so it never covers memory that a shrink handed back."""
        assert self.loaned_from is None and not self.pinned
        self._end_chain()
        self.finish_admissions()  # no copy may still write into a slot that becomes scratch
        wanted = -(-num_bytes // self.arena.slot_bytes)
        count = max(0, min(wanted, self.num_slots - self.min_slots))
        hi = self.num_slots
        lo = hi - count
        self._take_out_of_service(lo)
        self.loaned_from = lo
        return lo, hi

    def lent_bytes(self, lo: int, hi: int):
        """The lent slots [lo, hi) as one 1-D uint8 array (the memory a prefill's scratch uses)."""
        return self.arena.array[lo:hi].view(np.uint8).reshape(-1)

    def end_loan(self) -> None:
        self._end_chain()
        if self.loaned_from is not None:
            lo, self.loaned_from = self.loaned_from, None
            self._put_in_service(lo)

    # -- the forward pass -------------------------------------------------------------------------

    def acquire(self, layer: int, expert_ids) -> tuple[np.ndarray, np.ndarray]:
        """Pin the experts of one group and return (slots, ready). Misses are being copied in;
        call wait() before reading a slot that is not ready. Replaces the previous group's pins."""
        started = time.perf_counter()
        self.finish_admissions()
        keys = [self.store.key(layer, e) for e in expert_ids]
        if len(keys) > self.num_slots:
            raise CacheTooSmall(f"{len(keys)} experts in one group, {self.num_slots} slots")
        chain = self._chain_for_group()
        if chain is not None and self.pinned:  # a layer in several groups: the group before is released here,
            chain.released(self.copier.record_compute(), self.pinned)  # after its kernels (enqueued already)
        self.pinned = set()
        slots = np.empty(len(keys), dtype=np.int32)
        ready = np.ones(len(keys), dtype=bool)
        for i, key in enumerate(keys):  # hits first, so that a miss never evicts one of them
            slot = self.key_slot.get(key)
            if slot is not None:
                slots[i] = slot
                self.pinned.add(slot)
                self.policy.touch(key)
                self.hits += 1
                self.key_hits[key] += 1
        missed = [i for i, key in enumerate(keys) if key not in self.key_slot]
        if chain is None:
            victims = self._victims(len(missed) - len(self.free))
        elif self.copy_fence == "slot":
            row = getattr(self.store, "row_of_layer", {}).get(layer, 0)  # (a store without layers: no order ahead)
            victims = chain.victims(self, len(missed) - len(self.free), row)
        else:  # the policy's victims, sparing the last group's slots where it can
            victims = self._victims(len(missed) - len(self.free), chain.last_group())
            if len(victims) < len(missed) - len(self.free):
                victims = self._victims(len(missed) - len(self.free))
        copies = []
        for i in missed:
            key = keys[i]
            if self.free or not victims:
                slot = self._take_slot()
            else:
                slot = self.key_slot[victims.pop()]
                self._evict(slot)
            self._assign(slot, key)
            copies.append((slot, key))
            slots[i] = slot
            self.pinned.add(slot)
            self.misses += 1
            self.h2d_bytes += self.store.blob_bytes
        if copies:
            ready[missed] = self._copy_in(copies, chain)
        if self.timeline is not None:
            self.timeline.append(dict(layer=layer, group=len(keys), misses=len(copies),
                                      host_s=time.perf_counter() - started, **self._timeline_events(chain)))
        return slots, ready

    def _copy_in(self, copies: list[tuple[int, int]], chain) -> bool:
        """Enqueue the copies of (slot, key): in a chain each after its slot's fence, the earliest
        fences first, runs of consecutive slots and keys as one copy. Returns what the copier says of
        readiness (True: complete now)."""
        timed = self.timeline is not None and hasattr(self.copier, "record_copy")
        if chain is None:
            start = self.copier.record_copy() if timed else None
            done = all([self.copier.copy(slot, self.store.blob(key)) for slot, key in copies])
            if timed:  # (the first copy's fence comes after this event: its start is the fence's end at the latest)
                self._copy_events = dict(copy_start=start, copy_end=self.copier.record_copy(), runs=len(copies))
            return done
        runs = copy_runs(copies, [chain.fence_of(slot) for slot, _ in copies], self._contiguous())
        start = self.copier.record_copy() if timed else None
        done = True
        for slot, key, count, fence in runs:
            blob = self._run_blob(key, count)
            if blob is None:  # a store whose keys are not its rows in order: one copy a blob
                for j in range(count):
                    done &= self.copier.copy(slot + j, self.store.blob(key + j), fence)
            else:
                done &= self.copier.copy(slot, blob, fence)
        if timed:
            self._copy_events = dict(copy_start=start, copy_end=self.copier.record_copy(), runs=len(runs))
        return done

    def _contiguous(self) -> bool:
        """Whether consecutive keys' blobs may be copied as one (slots hold exactly one blob each)."""
        return self.arena.slot_bytes == self.store.blob_bytes and hasattr(self.store, "blobs")

    def _run_blob(self, key: int, count: int):
        """The blobs of keys key..key+count-1 as one (count, elems) array, or None where the store's
        rows are not its keys in order (HostStore's are)."""
        if count == 1:
            return self.store.blob(key)
        run = self.store.blobs[key:key + count]
        if len(run) != count or run.ctypes.data != self.store.blob(key).ctypes.data \
                or run[-1].ctypes.data != self.store.blob(key + count - 1).ctypes.data:
            return None
        return run

    def _chain_for_group(self):
        """The chain this group's copies join (None: they wait for all the work so far)."""
        if self.copy_fence == "all" or not getattr(self.copier, "fences", False):
            self._chain = None
            return None
        if self._chain is None:
            self._chain = Chain(self.copier.record_compute(), self.arena.max_slots)
        return self._chain

    def _end_chain(self) -> None:
        """Slots may be read outside groups from here on (a decode step, a loan, a resize): the next
        group's copies start a new chain, behind all the work enqueued before it."""
        self._chain = None

    def _timeline_events(self, chain) -> dict:
        """A group's events for a timeline: the compute stream at the end of its acquire (the work
        before its experts), its copies' start and end on the copy stream (where it had misses)."""
        fenced = getattr(self.copier, "fences", False)
        events = {"compute_at_acquire": self.copier.record_compute().event if fenced else None}
        events.update(self._copy_events or {})
        self._copy_events = None
        return events

    def wait(self) -> None:
        self.copier.wait()

    def release(self) -> None:
        """End the group: its slots may be evicted again. In a chain, the point of the compute stream
        after the group's kernels is each of its slots' fence; a release without a group (the end of a
        step) ends the chain."""
        if self._chain is not None:
            if self.pinned:
                self._chain.released(self.copier.record_compute(), self.pinned)
                if self.timeline is not None and self.timeline:
                    self.timeline[-1]["released"] = self._chain.last.event
            else:
                self._end_chain()
        self.pinned = set()
        for slot in range(self.num_reserved):  # the prefetch's banks back from a prefill group
            if self.slot_key[slot] != EMPTY:
                self._evict(slot)

    def _victims(self, count: int, protected=frozenset()) -> list[int]:
        """The ``count`` resident keys _take_slot would evict one after another (scores do not move
        while a group's misses take slots), last to evict first: one sort instead of a scan each.
        Slots in ``protected`` are spared as the pinned ones are (fewer than ``count`` may come back)."""
        if count <= 0:
            return []
        weakest = self.policy.weakest_first(count + len(self.pinned) + len(protected))
        spared = self.pinned | protected
        return [k for k in weakest if self.key_slot[k] not in spared][:count][::-1]

    def _take_slot(self) -> int:
        if self.free:
            return self.free.pop()
        key = self.policy.victim(lambda k: self.key_slot[k] not in self.pinned)
        if key is None:  # every slot in service pinned: a prefetch bank slot, until release()
            slot = next((s for s in range(self.num_reserved) if self.slot_key[s] == EMPTY), None)
            assert slot is not None, "every slot pinned: groups are capped at num_slots"
            return slot
        slot = self.key_slot[key]
        self._evict(slot)
        return slot

    def _assign(self, slot: int, key: int, visible: bool = True) -> None:
        self.slot_key[slot] = key
        self.key_slot[key] = slot
        self.policy.insert(key)
        if visible:
            self._place(key, slot)
        else:
            self.pending[key] = slot

    def _evict(self, slot: int) -> None:
        key = int(self.slot_key[slot])
        self.slot_key[slot] = EMPTY
        del self.key_slot[key]
        self.key_hits[key] = 0  # an expert admitted again counts its hits anew
        self.policy.remove(key)
        self.pending.pop(key, None)
        self._place(key, host_placement(key))

    def _place(self, key: int, entry: int) -> None:
        self._flat_placement[key] = entry
        self._placement_dirty = True

    # -- the decode path: placement table, observe, admission -------------------------------------

    def device_placement(self, ops):
        """The placement table as the kernels see it, brought up to date in stream order: every
        kernel enqueued after this call reads the table as it is now."""
        self._end_chain()  # decode kernels read slots outside groups
        if self._device_placement is None:
            self._device_placement = ops.persist(self.placement)
        elif self._placement_dirty:
            if self._uploads is None:
                self._uploads = PlacementUploads(ops)
            self._uploads.overwrite(self._device_placement, self.placement)
        self._placement_dirty = False
        return self._device_placement

    def observe(self, chosen: np.ndarray, ops=None, read: np.ndarray | None = None) -> None:
        """One routed step's choices, (layer rows, T, A) expert ids in the store's layer order:
        count hits and misses per distinct expert, feed the policy, start admissions. ``ops``: the
        backend whose stream the kernels run on (the table is re-uploaded there before a copy);
        ``read``: the placement table the step read, where it has changed since (a step launched
        ahead, workers/overlap.py; None: the table as it is)."""
        self._end_chain()
        if self.trace is not None:
            self.trace.append(np.array(chosen))
        num_experts = self.store.num_experts
        rows = np.arange(chosen.shape[0], dtype=np.int64)[:, None, None]
        seen = np.zeros(len(self._flat_placement), bool)  # the distinct keys, ascending (np.unique's
        seen[(rows * num_experts + chosen).reshape(-1)] = True  # hash: ~190 us at 48 layers x 8 tokens)
        keys = np.flatnonzero(seen)
        resident = (self._flat_placement if read is None else read.reshape(-1))[keys] >= 0
        self.hits += int(resident.sum())
        # the dashboard's map counts hits per resident expert (keys unique; still resident, where ``read`` is older)
        self.key_hits[keys[resident & (self._flat_placement[keys] >= 0)]] += 1
        missed = keys[~resident]
        self.misses += len(missed)
        self._note_misses(len(missed))
        self.h2d_bytes += len(missed) * self.store.blob_bytes  # read over PCIe by the kernels
        self.policy.observe(keys)
        self.land_admissions()
        if not self.pending:
            self._admit([k for k in missed.tolist() if k not in self.key_slot], ops, room=self.link_room(len(missed)))

    def observe_prefetch(self, keys: np.ndarray, chosen: np.ndarray) -> None:
        """One routed step's prefetch (bank keys (L, K)) against its choices (before ``observe``)."""
        self.h2d_bytes += self.prefetch.observe(keys, chosen) * self.store.blob_bytes  # wasted copies

    def _note_misses(self, count: int) -> None:
        typical = self.typical_misses
        self.typical_misses = float(count) if typical is None else typical + (count - typical) / TYPICAL_MISSES_STEPS

    def link_room(self, misses: int) -> int:
        """How many experts a decode step that missed ``misses`` may admit (see ADMISSION_FLOOR)."""
        if not self.admission_peak or self.typical_misses is None:
            return self.max_admissions
        return max(ADMISSION_FLOOR, int(self.admission_peak * self.typical_misses) - misses)

    def _admit(self, missed: list[int], ops, room: int) -> None:
        budget = min(self.max_admissions, len(missed), room)
        if budget == 0:  # (a loan held across steps, spanning_chunk.py: the slots below it; the lent are out of service)
            return
        candidates = self.policy.strongest_first(np.array(missed, np.int64))[:budget].tolist()
        victims = self.policy.weakest_first(max(0, budget - len(self.free)))
        admitted = []
        for key in candidates:
            if self.free:
                slot = self.free.pop()
            elif victims and self.policy.worth_admitting(key, victims[0]):
                slot = self.key_slot[victims.pop(0)]
                self._evict(slot)
            else:
                break  # candidates come strongest first: the rest would lose too
            admitted.append((key, slot))
        if not admitted:
            return
        if self._device_placement is not None and ops is not None:
            self.device_placement(ops)  # victims point at the host before their slot is overwritten
        # behind all the compute enqueued so far: a step launched ahead (workers/overlap.py) may still read the victims
        fence = self.copier.record_compute() if getattr(self.copier, "fences", False) else None
        for key, slot in admitted:
            ready = self.copier.copy(slot, self.store.blob(key), fence)
            self._assign(slot, key, visible=ready)
            self.h2d_bytes += self.store.blob_bytes
        self.copier.mark()
        self.land_admissions()

    def land_admissions(self, block: bool = False) -> None:
        """Point the table at admitted slots whose copies are complete (``block``: wait for them)."""
        if not self.pending:
            return
        if block:
            self.copier.sync()
        elif not self.copier.is_done():
            return
        self.copier.wait()  # later kernels on the compute stream are ordered after the copies
        for key, slot in self.pending.items():
            self._place(key, slot)
        self.pending = {}

    def finish_admissions(self) -> None:
        self.land_admissions(block=True)

    def preload(self) -> int:
        """Fill free slots before serving, expert-major across layers (every layer gets its share);
        returns how many experts were copied. Copies are complete when it returns."""
        self._end_chain()
        rows, num_experts = self.placement.shape
        order = [row * num_experts + e for e in range(num_experts) for row in range(rows)]
        count = 0
        for key in order:
            if not self.free:
                break
            if key in self.key_slot:
                continue
            slot = self.free.pop()
            ready = self.copier.copy(slot, self.store.blob(key))
            self._assign(slot, key, visible=ready)
            count += 1
        self.copier.mark()
        self.finish_admissions()
        return count

    # -- VRAM requests ----------------------------------------------------------------------------

    def resize(self, reserve_mib: float | None, query: bool = False, beside=None) -> dict:
        """Apply a reserve (MiB that must be free on the device) or, with None, go back to the full
        start-up size. Runs between steps: nothing is pinned. ``beside``: where a reserve releases
        segments, called once their slots are out of service and before they are unmapped (the worker
        launches the next decode step there, which then runs beside the unmap: see ``_shrink_for``)."""
        assert not self.pinned and self.loaned_from is None, "resize while a step holds experts or a loan"
        self._end_chain()
        started = time.perf_counter()
        self.finish_admissions()
        segments = len(self.arena.mapped)
        self.last_resize = {"admissions_wait_s": time.perf_counter() - started}  # the worker logs it
        if query:
            return self.report()
        if reserve_mib is None:
            self.reserve_mib = self.startup_reserve_mib
            self._grow(None)
        else:
            self.reserve_mib = float(reserve_mib)
            asked = time.perf_counter()
            free, _ = self.arena.memory_info()
            self.last_resize["info_s"] = time.perf_counter() - asked
            self.last_resize["free_before_mib"] = free / MIB
            missing = int(self.reserve_mib * MIB) - free
            if missing > 0:
                self._shrink_for(missing, beside)
            else:
                self._grow_within(-missing)
        self.last_resize["segments"] = len(self.arena.mapped) - segments  # < 0: released
        return self.report()

    def _shrink_for(self, missing_bytes: int, beside=None) -> None:
        """Release the fewest tail segments that free ``missing_bytes`` (the model must still run:
        ``min_slots`` stay, enough for one expert group). With ``beside``: once the leaving slots are
        out of service (the table no longer names them; the moves down are enqueued on the compute
        stream), an event marks the compute stream's end, ``beside()`` runs (the next decode step is
        launched: it reads the table as it is now, none of the leaving slots), and the unmap waits for
        that event only, not for the step."""
        count, _ = self.arena.tail_to_release(missing_bytes, self.min_slots)
        kept = self.arena.slots_after_shrink(count)
        started = time.perf_counter()
        self.last_resize["moved"] = self._keep_hottest(kept) if count else 0
        self._take_out_of_service(kept)
        self.last_resize["out_of_service_s"] = time.perf_counter() - started  # the moves down and the table
        after = None
        if beside is not None and count:
            fence = self.copier.record_compute() if getattr(self.copier, "fences", False) else None
            started = time.perf_counter()
            self.last_resize["beside"] = bool(beside())
            self.last_resize["beside_s"] = time.perf_counter() - started  # the next step's launch
            after = None if fence is None else fence.event
        self.arena.last_release = {}
        self.arena.shrink(count, after=after)
        self.last_resize.update(self.arena.last_release)  # (vmm: sync_s, unmap_s, release_s)

    def _keep_hottest(self, first: int) -> int:
        """Before slots from ``first`` leave service: their experts move down (a copy on the device
        each, ordered before the shrink's unmap) into free slots, or in place of weaker experts, so
        the cache keeps its hottest rather than whichever sat in the tail (which the next steps would
        then miss and copy in again over PCIe). Returns how many moved."""
        leaving = [int(k) for k in self.slot_key[first:self.num_slots] if k != EMPTY]
        if not leaving:
            return 0
        leaving = self.policy.strongest_first(np.array(leaving, np.int64)).tolist()
        free = [s for s in self.free if s < first]
        victims = [k for k in self.policy.weakest_first(len(self.key_slot)) if self.key_slot[k] < first]
        moved = 0
        for key in leaving:
            if free:
                dst = free.pop()
                self.free.remove(dst)
            elif victims and self.policy.worth_keeping(key, victims[0]):
                dst = self.key_slot[victims.pop(0)]
                self._evict(dst)
            else:
                break  # strongest first: the rest would lose too
            src = self.key_slot[key]
            self.copier.move(src, dst)
            self.slot_key[src], self.slot_key[dst], self.key_slot[key] = EMPTY, key, dst
            self._place(key, dst)
            moved += 1
        return moved

    def _grow_within(self, spare_bytes: int) -> None:
        count = 0
        pending = self.arena.startup_segments[len(self.arena.mapped):]
        while count < len(pending) and pending[count] <= spare_bytes:
            spare_bytes -= pending[count]
            count += 1
        self._grow(count)

    def _grow(self, count: int | None) -> None:
        before = self.num_slots
        self.arena.grow(count)
        self._put_in_service(before)

    def _take_out_of_service(self, first: int) -> None:
        """Slots from ``first`` up to num_slots leave service (shrink, loan): evict, unlist."""
        for slot in range(first, self.num_slots):
            if self.slot_key[slot] != EMPTY:
                self._evict(slot)
        self.free = [s for s in self.free if s < first]

    def _put_in_service(self, first: int) -> None:
        """Slots from ``first`` up to num_slots are empty and usable again (grow, end of a loan)."""
        self.free = list(range(self.num_slots - 1, first - 1, -1)) + self.free

    def report(self) -> dict:
        free, _ = self.arena.memory_info()
        return {"reserve_mib": self.reserve_mib, "free_mib": round(free / MIB, 1),
                "expert_slots": self.num_slots, "expert_cache_mib": round(self.arena.mapped_bytes / MIB, 1)}

    def stats(self, report: dict | None = None) -> dict:
        """``report``: the sizes to give (a VRAM request's, kept by the worker) instead of asking the driver now."""
        # the dtype decides how many experts a MiB holds: fp8 ~2x and int4 ~3.5x bf16's slots
        return {"hits": self.hits, "misses": self.misses, "h2d_bytes": self.h2d_bytes,
                "resident_experts": len(self.key_slot), "experts_dtype": getattr(self.store, "experts_dtype", "bf16"),
                "expert_slot_bytes": int(self.store.blob_bytes), **(self.report() if report is None else report),
                **(self.prefetch.stats() if self.prefetch is not None else {})}

    def residency(self) -> dict:
        """Which (layer, expert) are resident and their hits since admission, compact enough for
        every INFO reply: ``keys`` are the store's keys (row * num_experts + expert, where row
        indexes ``layers``), ``hits`` the hit count of each, in the same order."""
        keys = sorted(self.key_slot)
        return {"layers": list(getattr(self.store, "layers", [])), "num_experts": int(self.store.num_experts),
                "keys": keys, "hits": self.key_hits[keys].tolist()}

