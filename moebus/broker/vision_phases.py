"""The decode steps that ran in each phase of a cold image start: how many, and their mean time from
plan to tokens and inside the workers. A text stream's gap in a phase is at least one of its steps;
these say whether a phase's long gaps were long steps (the GPU shared with a starting vision worker,
a prefill chunk beside the decode) or time between steps (the broker, a hand-back's resize).

The marks are taken from the broker's step counters (broker/stats.py) as the lifecycle passes them;
the first token's is taken on the loop turn after it was streamed, so it may count one step more."""
from __future__ import annotations

DURATIONS = ("queued_s", "handback_s", "start_s", "worker_start_s", "ready_to_encode_s", "encode_s")
MARKS = ("began", "handed_back", "ready", "encode_sent", "submitted", "first_token")
PHASES = {"handback": ("began", "handed_back"), "start": ("handed_back", "ready"),
          "ready_to_encode": ("ready", "encode_sent"), "encode": ("encode_sent", "submitted"),
          "prefill": ("submitted", "first_token")}


class PhaseSteps:
    def __init__(self, stats):
        self.stats = stats
        self.tallies: dict[str, tuple[int, float, float]] = {}

    def mark(self, name: str) -> None:
        """The step counters as ``name`` (one of MARKS) is reached; the first time only."""
        assert name in MARKS, name
        if name not in self.tallies:
            h = self.stats.histograms
            self.tallies[name] = (self.stats.counters["steps_total"], h["step_seconds"].sum,
                                  h["step_compute_seconds"].sum)

    def by_phase(self) -> dict[str, dict]:
        """Per phase whose two marks were reached: steps, and their mean ms (None without steps)."""
        out = {}
        for phase, (a, b) in PHASES.items():
            if a in self.tallies and b in self.tallies:
                (n0, step0, compute0), (n1, step1, compute1) = self.tallies[a], self.tallies[b]
                steps = n1 - n0
                out[phase] = {"steps": steps, "step_ms": 1e3 * (step1 - step0) / steps if steps else None,
                              "compute_ms": 1e3 * (compute1 - compute0) / steps if steps else None}
        return out


def cold_start_split(cycle: dict, steps: PhaseSteps) -> dict:
    """INFO's ``vision.last_cold_start`` from the lifecycle's record of it (``last_cycle``): the
    phases' lengths, the prefill's once its first token came, the hand-back's request count and the
    steps by phase."""
    split = {k: v for k, v in cycle.items() if k in DURATIONS}
    seq = cycle.get("seq")
    if seq is not None and seq.first_token_s is not None:
        split["prefill_s"] = seq.first_token_s - cycle["submitted_s"]
    return {**split, "handback_requests": cycle.get("handback_requests"), "steps": steps.by_phase()}
