"""Text streams decoding through a cold image start (``moebus bench vision-cycle``): each stream's own
inter-token gaps, the broker's step figures in their steady state, and the gaps by phase of the
cold start (queued, hand-back, vision worker start, encode, the image prompt's prefill, its decode).

Each stream's gaps are its own (two streams in one batch get their tokens from the same step, so a
merged timeline would hold a ~0 gap per step). The streams run until the image request has
answered its last token, so every phase of the cold start has text steps beside it; a gap belongs
to the phase that holds its middle (most of it: a text token of the step that made the image's
first token reaches the client just after that one), so a gap above the target names its cause."""
from __future__ import annotations

import statistics
import threading
import time

from moebus.broker.vision_phases import CACHE_KEYS, cache_per_step

WARM_TOKENS = 8  # of each text stream before the steady state is measured (batch sizes captured, experts cached)
STEADY_TOKENS = 24  # each stream's tokens in the steady state measured before the image is sent
# each stream's tokens in an image-free window between the warm-up and the steady state (``--control-tokens``): about
# as many gaps as the H200's cold start holds until encoded (~250 steps), so that the largest of them is the text's own
# tail, without any image, for the largest gap through the hand-back, start and encode to be read against
CONTROL_TOKENS = 256
PHASES = ("queued", "handback", "start", "ready_to_encode", "encode", "prefill", "decode")


def stream_prompt(i: int, prompt_tokens: int = 3) -> list[int]:
    """Text stream ``i``'s prompt ids (greedy from there; ``bench cache --trace streams`` replays them)."""
    return [5 + i] + [17, 99, 23][: prompt_tokens - 1]


class TextStreams:
    """``count`` text streams started at once, each up to ``max_tokens`` tokens or until ``stop``:
    their token arrival times (monotonic s), one list per stream."""

    def __init__(self, client, count: int, max_tokens: int, prompt_tokens: int = 3):
        self.times: list[list[float]] = [[] for _ in range(count)]
        self.streams = [client.generate(prompt_tokens=stream_prompt(i, prompt_tokens), max_tokens=max_tokens,
                                        temperature=0, ignore_eos=True) for i in range(count)]
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        stream = self.streams[i]
        for part in stream:
            self.times[i] += [time.monotonic()] * len(part.tokens)
            if self.stopping.is_set():  # cancelled by its own thread, which then reads no more replies
                stream.close()
                return

    def wait_tokens(self, count: int, timeout_s: float = 60.0) -> None:
        """Until every stream holds ``count`` tokens (or has ended)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(len(ts) >= count or not t.is_alive() for ts, t in zip(self.times, self.threads)):
                return
            time.sleep(0.002)

    def stop(self) -> float:
        """Cancel the streams that still run (each at its next token); returns when that was asked."""
        ended = time.monotonic()
        self.stopping.set()
        self.join()
        return ended

    def join(self) -> None:
        for t in self.threads:
            t.join()

    def ran_until(self) -> float:
        """When the first stream to end had its last token: the record covers the time until then."""
        return min((ts[-1] for ts in self.times if ts), default=0.0)


def gaps_within(times: list[list[float]], start: float, end: float) -> list[list[float]]:
    """Each stream's own gaps whose middle lies in [start, end)."""
    return [[b - a for a, b in zip(ts, ts[1:]) if start <= (a + b) / 2 < end] for ts in times]


def summary_ms(gaps: list[float]) -> dict:
    return {"n": len(gaps), "median_ms": 1e3 * statistics.median(gaps) if gaps else None,
            "max_ms": 1e3 * max(gaps) if gaps else None}


def phase_bounds(sent: float, split: dict, ended: float) -> list[tuple[str, float, float]]:
    """(phase, start, end) from the image request's send time and the broker's time split; the
    prefill ends at the image's first token at the client (``first_token_s``, when given: the text
    tokens of the step that made it reach the client with it, after the broker's own mark), and
    its decode runs from there to ``ended``."""
    bounds, start = [], sent
    for phase in PHASES[:-1]:
        end = start + split.get(f"{phase}_s", 0.0)
        if phase == "prefill" and "first_token_s" in split:
            end = max(start, sent + split["first_token_s"])
        bounds.append((phase, start, end))
        start = end
    bounds.append(("decode", start, max(start, ended)))
    return bounds


def gaps_by_phase(times: list[list[float]], sent: float, split: dict, ended: float) -> dict:
    """Per phase of the cold start: its length and its gaps (pooled over the streams, each gap a
    stream's own): count, median, largest."""
    return {phase: {"length_ms": 1e3 * (end - start), **summary_ms(sum(gaps_within(times, start, end), []))}
            for phase, start, end in phase_bounds(sent, split, ended)}


def steady_steps(before: dict, after: dict, seconds: float) -> dict:
    """The broker's steps between two INFO replies: how many, their interval, their mean time from
    plan to tokens (``step_seconds``) and the workers' own compute time (``step_compute_seconds``)."""
    steps = after["counters"]["steps_total"] - before["counters"]["steps_total"]

    def mean_ms(name: str) -> float | None:
        total = after["histograms"][name]["sum"] - before["histograms"][name]["sum"]
        return 1e3 * total / steps if steps else None
    return {"steps": steps, "interval_ms": 1e3 * seconds / steps if steps else None,
            "step_ms": mean_ms("step_seconds"), "compute_ms": mean_ms("step_compute_seconds")}


def _worker_counters(info: dict) -> dict:
    """The GPU workers' steps and caches' counters in a broker INFO, summed over the workers."""
    gpus = info.get("gpus") or []
    out = {k: sum(int(g.get(k, 0)) for g in gpus) for k in ("steps", *CACHE_KEYS)}
    out["slot_bytes"] = max((int(g.get("expert_slot_bytes", 0)) for g in gpus), default=0)
    return out


def _fresh_counters(client, timeout_s: float) -> dict | None:
    """The workers' counters from an INFO asked for now: a VRAM query's answer makes the broker ask
    every worker for INFO on its next turn; the figures are fresh once their step count moves."""
    old = _worker_counters(client.info())
    client.vram(query=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = _worker_counters(client.info())
        if now["steps"] != old["steps"]:
            return now
        time.sleep(0.01)
    return None


def steady_cache(client, window_s: float = 0.5, timeout_s: float = 5.0) -> dict | None:
    """The caches' traffic per step while the text streams decode alone, between two fresh INFO
    replies of the workers ``window_s`` apart: misses, MiB over PCIe and copies beyond the misses,
    per step (vision_phases.cache_per_step). None when the workers did not answer in time."""
    first = _fresh_counters(client, timeout_s)
    time.sleep(window_s)
    second = _fresh_counters(client, timeout_s) if first else None
    if second is None or second["steps"] <= first["steps"]:
        return None
    steps = second["steps"] - first["steps"]
    return {"steps": steps, **cache_per_step(first, second, steps)}


def gap_report(streams: TextStreams, steady: tuple[float, float], sent: float, split: dict, ended: float,
               steps: dict, cache: dict | None = None, control: tuple[float, float] | None = None) -> dict:
    """Everything the bench prints about the text streams (plain data, for its JSON line too). ``control``:
    the image-free window before the steady one (its largest gap against the same medians: the text's own tail)."""
    start, end = steady
    before = gaps_within(streams.times, start, end)
    free = gaps_within(streams.times, *control) if control else [[] for _ in streams.times]
    cold = gaps_within(streams.times, sent, ended)
    encoded = sent + sum(split.get(f"{p}_s", 0.0) for p in PHASES[:5])
    until_encoded = gaps_within(streams.times, sent, encoded)
    cycle = gaps_within(streams.times, start, ended)  # the issue's wording: the streams' median over the cycle
    per_stream = []
    for mine, through, upto, whole, alone in zip(before, cold, until_encoded, cycle, free):
        median = statistics.median(mine) if mine else None
        median_cycle = statistics.median(whole) if whole else None
        per_stream.append({"median_before_ms": 1e3 * median if median else None,
                           "median_cycle_ms": 1e3 * median_cycle if median_cycle else None,
                           "max_until_encoded_ms": 1e3 * max(upto) if upto else None,
                           "max_cold_ms": 1e3 * max(through) if through else None,
                           "ratio_until_encoded": max(upto) / median if upto and median else None,
                           "ratio_cold": max(through) / median if through and median else None,
                           "ratio_until_encoded_cycle": max(upto) / median_cycle if upto and median_cycle else None,
                           "ratio_cold_cycle": max(through) / median_cycle if through and median_cycle else None,
                           "max_control_ms": 1e3 * max(alone) if alone else None,
                           "ratio_control": max(alone) / median if alone and median else None,
                           "ratio_control_cycle": max(alone) / median_cycle if alone and median_cycle else None,
                           "control_gaps": len(alone),
                           "ratio_until_encoded_control": max(upto) / max(alone) if upto and alone else None,
                           "cold_gaps": len(through),
                           "above_2x_cold": sum(g > 2 * median for g in through) if median else None})
    pooled = sum(before, [])
    return {"steady": {**summary_ms(pooled), "broker_steps": steps, "cache": cache}, "per_stream": per_stream,
            "control": {"seconds": control[1] - control[0], **summary_ms(sum(free, []))} if control else None,
            "by_phase": gaps_by_phase(streams.times, sent, split, ended),
            "covered": streams.ran_until() >= ended - 1e-3,
            "largest": largest_ms(streams.times, sent, 5, phase_bounds(sent, split, ended)),
            "sent_wall_s": time.time() - (time.monotonic() - sent)}  # the workers' log lines are in wall time


def largest_ms(times: list[list[float]], origin: float, count: int,
               bounds: list[tuple[str, float, float]] = ()) -> list[tuple[float, float, float, str]]:
    """The ``count`` largest gaps (any stream) whose middle is after ``origin``: (gap ms, ended ms after
    origin, began ms after origin, the phase of ``bounds`` (phase_bounds) that holds its middle, '' none)."""
    def phase_of(t: float) -> str:
        return next((name for name, start, end in bounds if start <= t < end), "")
    gaps = [(1e3 * (b - a), 1e3 * (b - origin), 1e3 * (a - origin), phase_of((a + b) / 2))
            for ts in times for a, b in zip(ts, ts[1:]) if a + b >= 2 * origin]
    return sorted(gaps, reverse=True)[:count]


def wall_clock(seconds: float) -> str:
    """A wall time as the workers' log lines print it (logging's asctime: local time, ms after a comma)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds)) + f",{int(1e3 * (seconds % 1)):03d}"


def ms(v) -> str:
    """A figure in ms as printed ('-': none)."""
    return "-" if v is None else f"{v:.1f}"


def print_gap_report(report: dict, num_streams: int, broker_steps: dict) -> None:
    """``broker_steps``: the broker's steps by phase of the cold start (its last_cold_start's ``steps``)."""
    steady, steps = report["steady"], report["steady"]["broker_steps"]
    print(f"{num_streams} text streams, steady state before the image: each stream's own gap median "
          f"{ms(steady['median_ms'])} ms (n {steady['n']}, max {ms(steady['max_ms'])}); broker: {steps['steps']} steps, "
          f"one every {ms(steps['interval_ms'])} ms, {ms(steps['step_ms'])} ms plan to tokens, "
          f"{ms(steps['compute_ms'])} ms in the worker")
    free = report.get("control")
    if free:
        print(f"  an image-free window before it ({1e3 * free['seconds']:.0f} ms): each stream's own gap median "
              f"{ms(free['median_ms'])} ms (n {free['n']}, max {ms(free['max_ms'])})")
    cache = report["steady"].get("cache")
    if cache:
        print(f"  caches while they decode alone: {cache['misses_per_step']:.1f} experts missed a step, "
              f"{cache['h2d_mib_per_step']:.1f} MiB over PCIe a step, {ms(cache['copies_per_step'])} copies a step "
              f"beyond the misses ({cache['steps']} steps between two INFO replies)")
    print(f"  {'phase':<16} {'length ms':>10} {'gaps':>5} {'median ms':>10} {'max ms':>8} {'max/median':>10}   "
          f"broker: {'steps':>5} {'step ms':>8} {'worker ms':>9}   caches: {'missed':>6} {'MiB':>6} {'copies':>6} a step")
    for phase, row in report["by_phase"].items():
        b = broker_steps.get(phase) or {}
        own = f"{row['max_ms'] / row['median_ms']:.2f}" if row["median_ms"] else "-"  # against the phase's own pace
        print(f"  {phase:<16} {row['length_ms']:>10.1f} {row['n']:>5} {ms(row['median_ms']):>10} {ms(row['max_ms']):>8}"
              f" {own:>10}           {b.get('steps', '-'):>5} {ms(b.get('step_ms')):>8} {ms(b.get('compute_ms')):>9}"
              f"           {ms(b.get('misses_per_step')):>6} {ms(b.get('h2d_mib_per_step')):>6}"
              f" {ms(b.get('copies_per_step')):>6}")
    for i, s in enumerate(report["per_stream"]):
        print(f"  stream {i}: median before {ms(s['median_before_ms'])} ms, over the cycle {ms(s['median_cycle_ms'])} ms; "
              f"largest through hand-back, start and encode {ms(s['max_until_encoded_ms'])} ms "
              f"({ms(s['ratio_until_encoded'])}x / {ms(s['ratio_until_encoded_cycle'])}x), through the whole cold start "
              f"to the image's last token {ms(s['max_cold_ms'])} ms ({ms(s['ratio_cold'])}x / {ms(s['ratio_cold_cycle'])}x); "
              f"over {s['control_gaps']} gaps without an image before it {ms(s['max_control_ms'])} ms "
              f"({ms(s['ratio_control'])}x / {ms(s['ratio_control_cycle'])}x); "
              f"{s['above_2x_cold']} of its {s['cold_gaps']} gaps there above 2x the median before")
    print("  largest gaps (ms, ended ms after the image was sent):",
          ", ".join(f"{g:.1f} at {t:.0f}" for g, t, *_ in report["largest"]))
    print("  largest gaps by phase (ms: from - to after the image was sent, phase):",
          ", ".join(f"{g:.1f}: {a:.0f} - {t:.0f} {phase or '-'}" for g, t, a, phase in report["largest"]))
    if report.get("sent_wall_s") is not None:
        print(f"  the image was sent at {wall_clock(report['sent_wall_s'])} (the log lines' clock)")
    if not report["covered"]:
        print("  note: a text stream ended before the image's last token (raise --max-context or --text-tokens)")


def worst_ratio(report: dict, key: str) -> float | None:
    """The largest per-stream ratio of ``key`` ('ratio_until_encoded', 'ratio_cold' or 'ratio_control' against
    the median before the image; the same with '_cycle' against the median over the whole cycle)."""
    ratios = [s[key] for s in report["per_stream"] if s[key] is not None]
    return max(ratios) if ratios else None
