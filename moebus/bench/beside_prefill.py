"""``moebus bench decode --beside-prefill N[,N2]``: what reading a long prompt does to the streams
that decode meanwhile (issue 19, item 4: 8 streams decoding while an 8k prompt prefills keep their
median inter-token gap within 2x of the gap without it). Through a private broker: STREAMS greedy
streams with short prompts decode; once they are steady, one request of N prompt tokens (max_tokens
1) arrives. Each stream's own inter-token gaps are split into *before* (the steady window just
before the long request is sent) and *during* (those overlapping the window from its submission to
its first token at the client). Per N: the median gap before, the median, mean and largest gap
during, median during / median before (the issue's figure; the mean shows what a median would hide
if only some steps were slow), the long prompt's time to first token and prefill tok/s, and the
broker's steps in both windows (its INFO histograms). A first round with a prompt of at most
WARM_PROMPT_TOKENS warms up (its chunks' step shapes are the timed ones', and are captured there) and
is not counted. The scheduler's chunking of the long prompt
(``max_step_tokens``, ``max_prefill_tokens_beside_decode``) comes from the environment, as the
broker reads it."""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

STREAMS = 8
WARM_TOKENS = 8  # each stream's tokens before the steady window (its batch size captured, experts cached)
BEFORE_GAPS = 16  # each stream's gaps in the steady window
MIN_STREAM_CONTEXT = 512  # the streams' room to keep decoding while a short prompt is read on a slow device
WAIT_S = 600.0  # for a stream's tokens, or the long request's first token
WARM_PROMPT_TOKENS = 1024  # the warm-up round's long prompt, at most (its chunks repeat the timed rounds' shapes)


class _Streams:
    """STREAMS greedy streams decoding until closed; the arrival time of each one's every token."""

    def __init__(self, client, count: int, max_tokens: int):
        self.times: list[list[float]] = [[] for _ in range(count)]
        self.ended = [False] * count
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(client, i, max_tokens), daemon=True)
                        for i in range(count)]
        for t in self.threads:
            t.start()

    def _run(self, client, i: int, max_tokens: int) -> None:
        try:
            with client.generate(prompt_tokens=[5 + i, 17, 99], max_tokens=max_tokens, temperature=0,
                                 ignore_eos=True) as stream:
                for part in stream:
                    self.times[i] += [time.perf_counter()] * len(part.tokens)
                    if self.stop.is_set():
                        return  # leaving the with cancels the request
        finally:
            self.ended[i] = not self.stop.is_set()  # by its length or an error: the round is void

    def wait_tokens(self, count: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while min(len(t) for t in self.times) < count:
            if any(self.ended) or time.monotonic() > deadline:
                raise RuntimeError(f"the {len(self.times)} streams did not all reach {count} tokens")
            time.sleep(0.002)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)

    def gaps_within_s(self, start: float, end: float) -> list[float]:
        """Gaps that began at ``start`` or later and ended by ``end``."""
        return [b - a for ts in self.times for a, b in zip(ts, ts[1:]) if a >= start and b <= end]

    def gaps_overlapping_s(self, start: float, end: float) -> list[float]:
        """Gaps that ended after ``start`` and began before ``end`` (a stream's gap that the window cut into)."""
        return [b - a for ts in self.times for a, b in zip(ts, ts[1:]) if b > start and a < end]


def prompt_lengths(text: str) -> list[int]:
    """``--beside-prefill``'s value: comma-separated prompt lengths, each at least one token."""
    try:
        lengths = [int(n) for n in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: prompt lengths N[,N2] of at least one token each")
    return lengths


def long_prompt(num_tokens: int) -> list[int]:
    return [(7 * i + 3) % 200 + 10 for i in range(num_tokens)]  # as bench decode's prompt, within any vocab


def _one_round(client, num_tokens: int, stream_tokens: int) -> dict:
    """Streams steady, then the long request: gaps before and during, its first token, the steps."""
    from moebus.bench.structured import _steps

    streams = _Streams(client, STREAMS, stream_tokens)
    try:
        streams.wait_tokens(WARM_TOKENS)
        steady_from, at_steady = time.perf_counter(), client.info()
        streams.wait_tokens(WARM_TOKENS + 1 + BEFORE_GAPS)
        at_sent = client.info()
        sent = time.perf_counter()
        with client.generate(prompt_tokens=long_prompt(num_tokens), max_tokens=1, temperature=0) as long:
            next(long)
            first = time.perf_counter()
            for _ in long:  # its Final
                pass
        at_first = client.info()
        if any(streams.ended):
            raise RuntimeError("a stream ended before the long prompt's first token: raise max_context")
    finally:
        streams.close()
    before = streams.gaps_within_s(steady_from, sent)
    during = streams.gaps_overlapping_s(sent, first)
    return {"before": before, "during": during, "first_token_s": first - sent,
            "steps_before": _steps(at_steady, at_sent), "steps_during": _steps(at_sent, at_first)}


def _figures(num_tokens: int, r: dict) -> dict:
    before_ms, during_ms = statistics.median(r["before"]) * 1e3, statistics.median(r["during"]) * 1e3
    out = {"gap_before_ms": round(before_ms, 2), "gap_during_ms": round(during_ms, 2),
           "gap_during_mean_ms": round(statistics.fmean(r["during"]) * 1e3, 2),
           "gap_during_max_ms": round(max(r["during"]) * 1e3, 2), "gap_ratio": round(during_ms / before_ms, 3),
           "gaps_during": len(r["during"]), "first_token_s": round(r["first_token_s"], 4),
           "prefill_tok_s": round(num_tokens / r["first_token_s"], 1)}
    for window in ("before", "during"):
        out.update({f"{window}_{k}": v for k, v in r[f"steps_{window}"].items()})
    return {f"beside{num_tokens}_{k}": v for k, v in out.items()}


def compare(model_dir: str | None, device: str, lengths: list[int], quiet: bool = True) -> dict:
    """Per prompt length N: the gaps of STREAMS decoding streams before and while N tokens prefill.
    A first round (the shortest N, at most WARM_PROMPT_TOKENS) warms up and is not counted; the
    broker's start (to READY, its workers' warm-up included) is ``beside_broker_ready_s``.
    ``quiet`` False: the broker's and workers' logs go to stderr, with a line per round."""
    from moebus.bench.structured import _worker_counts
    from moebus.broker.scheduler import prefill_tokens_beside_decode
    from moebus.cli_generate import private_broker
    from moebus.client import Client
    from moebus.common.settings import load_settings

    settings = load_settings()  # what the private broker reads too, but for the two values set below
    max_context = max(max(lengths), MIN_STREAM_CONTEXT) + 8
    flags = ["--device", device] + (["--model", model_dir] if model_dir else [])
    env = {"MOEBUS_MAX_CONTEXT": str(max_context), "MOEBUS_MAX_BATCH": str(STREAMS + 1)}
    out = {"beside_max_step_tokens": settings.max_step_tokens,
           "beside_max_prefill_tokens_beside_decode": prefill_tokens_beside_decode(
               settings.max_prefill_tokens_beside_decode, device)}
    started = time.perf_counter()
    with private_broker(flags, env=env, quiet=quiet) as address:
        out["beside_broker_ready_s"] = round(time.perf_counter() - started, 1)
        _say(quiet, f"broker ready after {out['beside_broker_ready_s']} s")
        client = Client(address)
        try:
            _one_round(client, min(min(lengths), WARM_PROMPT_TOKENS), max_context - 8)
            _say(quiet, f"warm-up round done at {time.perf_counter() - started:.1f} s")
            counts = _worker_counts(client) if device != "cpu" else {}
            for n in lengths:
                out.update(_figures(n, _one_round(client, n, max_context - 8)))
                _say(quiet, f"round of {n} done at {time.perf_counter() - started:.1f} s")
            if counts:  # a graph captured or a short step run eagerly (compiling?) inside the timed rounds
                out.update({f"beside_worker_{k}": v - counts[k] for k, v in _worker_counts(client).items()})
        finally:
            client.close()
    return out


def _say(quiet: bool, line: str) -> None:
    if not quiet:
        print(f"beside_prefill: {line}", file=sys.stderr, flush=True)
