"""The decode steps that ran in each phase of a cold image start: how many, and their mean time from
plan to tokens and inside the workers. A text stream's gap in a phase is at least one of its steps;
these say whether a phase's long gaps were long steps (the GPU shared with a starting vision worker,
a prefill chunk beside the decode) or time between steps (the broker, a hand-back's resize).

The marks are taken from the broker's step counters (broker/stats.py) as the lifecycle passes them;
the first token's is taken on the loop turn after it was streamed, so it may count one step more.

With ``ask_info`` each mark also asks every GPU worker for INFO and keeps their expert caches'
counters (hits, misses, bytes over PCIe) from the first reply of each after it: per phase, the
experts each step missed (read in place over PCIe) and the bytes it moved, so a slow phase says
whether its steps missed more or copied more (admissions, a prefill's copies, the prefetch's wasted
banks: ``h2d_bytes`` beyond the misses). An INFO waits behind the step in flight, so these counters
lag the broker's mark by about one step at both ends."""
from __future__ import annotations

DURATIONS = ("queued_s", "handback_s", "start_s", "worker_start_s", "ready_to_encode_s", "encode_s")
MARKS = ("began", "handed_back", "ready", "encode_sent", "submitted", "first_token")
PHASES = {"handback": ("began", "handed_back"), "start": ("handed_back", "ready"),
          "ready_to_encode": ("ready", "encode_sent"), "encode": ("encode_sent", "submitted"),
          "prefill": ("submitted", "first_token")}


CACHE_KEYS = ("hits", "misses", "h2d_bytes")  # of each GPU worker's INFO (ExpertCache.stats)
MIB = 1 << 20


class PhaseSteps:
    def __init__(self, stats, num_workers: int = 0, ask_info=None):
        """``ask_info()``: the broker asks every GPU worker for INFO (None: no cache counters)."""
        self.stats = stats
        self.tallies: dict[str, tuple[int, float, float]] = {}
        self.num_workers, self.ask_info = num_workers, ask_info
        self.awaiting: dict[str, set[int]] = {}  # mark -> the workers whose INFO after it has not come
        self.infos: dict[int, dict] = {}  # gpu -> its last INFO since this cold start began
        self.cache: dict[str, dict] = {}  # mark -> the caches' counters, summed over the workers

    def mark(self, name: str) -> None:
        """The step counters as ``name`` (one of MARKS) is reached; the first time only."""
        assert name in MARKS, name
        if name not in self.tallies:
            h = self.stats.histograms
            self.tallies[name] = (self.stats.counters["steps_total"], h["step_seconds"].sum,
                                  h["step_compute_seconds"].sum)
            if self.ask_info is not None and self.num_workers:
                self.awaiting[name] = set(range(self.num_workers))
                self.ask_info()

    def on_worker_info(self, gpu: int, info: dict) -> None:
        """A GPU worker's INFO reply: a mark whose every worker has now answered gets their counters."""
        self.infos[gpu] = info
        for name, waiting in list(self.awaiting.items()):
            waiting.discard(gpu)
            if not waiting:
                del self.awaiting[name]
                self.cache[name] = {k: sum(int(i.get(k, 0)) for i in self.infos.values()) for k in CACHE_KEYS}
                self.cache[name]["slot_bytes"] = max(int(i.get("expert_slot_bytes", 0)) for i in self.infos.values())

    def by_phase(self) -> dict[str, dict]:
        """Per phase whose two marks were reached: steps, and their mean ms (None without steps)."""
        out = {}
        for phase, (a, b) in PHASES.items():
            if a in self.tallies and b in self.tallies:
                (n0, step0, compute0), (n1, step1, compute1) = self.tallies[a], self.tallies[b]
                steps = n1 - n0
                out[phase] = {"steps": steps, "step_ms": 1e3 * (step1 - step0) / steps if steps else None,
                              "compute_ms": 1e3 * (compute1 - compute0) / steps if steps else None}
                if steps and a in self.cache and b in self.cache:
                    out[phase].update(cache_per_step(self.cache[a], self.cache[b], steps))
        return out


def cache_per_step(before: dict, after: dict, steps: int) -> dict:
    """The caches' traffic between two readings, per step: experts missed (read in place), MiB over
    PCIe, and the copies beyond the misses (admissions, prefill copies, wasted prefetch banks)."""
    misses = after["misses"] - before["misses"]
    moved = after["h2d_bytes"] - before["h2d_bytes"]
    slot = after.get("slot_bytes") or 0
    return {"misses_per_step": misses / steps, "h2d_mib_per_step": moved / MIB / steps,
            "copies_per_step": (moved / slot - misses) / steps if slot else None}


def cold_start_split(cycle: dict, steps: PhaseSteps) -> dict:
    """INFO's ``vision.last_cold_start`` from the lifecycle's record of it (``last_cycle``): the
    phases' lengths, the prefill's once its first token came, the hand-back's request count and the
    steps by phase."""
    split = {k: v for k, v in cycle.items() if k in DURATIONS}
    seq = cycle.get("seq")
    if seq is not None and seq.first_token_s is not None:
        split["prefill_s"] = seq.first_token_s - cycle["submitted_s"]
    return {**split, "handback_requests": cycle.get("handback_requests"), "steps": steps.by_phase()}
