"""A request's tokens on their way to its client, and its end: each sampled token becomes a PARTIAL
(text, logprobs, top logprobs), and a request leaves the scheduler with a FINAL (finished or
cancelled) or an ERROR (failed), counted in the metrics either way."""
from __future__ import annotations

import math
import time

from moebus.broker.scheduler import Scheduler
from moebus.broker.sequence import Sequence
from moebus.broker.stats import Stats
from moebus.common.protocol import Error, Final, Partial, StepReply
from moebus.common.tokenizer import TextTokenizer


def finite_logprob(value) -> float:
    """A logprob fit for JSON: -inf (a token the sampler could not have drawn) and NaN become -9999,
    OpenAI's figure for "as unlikely as it gets"."""
    value = float(value)
    return value if math.isfinite(value) else -9999.0


class Streaming:
    """The Broker's streaming methods (a mixin: the state is the Broker's, named below)."""

    scheduler: Scheduler
    stats: Stats
    tokenizer: TextTokenizer

    def _accept(self, seq: Sequence, token: int, now: float) -> str:
        """A sampled token joins its sequence (the text to stream comes back); a sequence that
        finished leaves the scheduler now, so the next step's plan has its slot. Its PARTIAL and
        FINAL follow in ``_stream``, once the next STEP is out."""
        previous_s = seq.last_token_s
        text = seq.accept(token, now)
        self.stats.count("generation_tokens_total")
        if previous_s is None:
            self.stats.count("prompt_tokens_total", len(seq.prompt))
            self.stats.observe("time_to_first_token_seconds", now - seq.arrived_s)
        else:
            self.stats.observe("inter_token_latency_seconds", now - previous_s)
        if seq.finish_reason:
            self.scheduler.remove(seq)
        return text

    def _stream(self, seq: Sequence, token: int, text: str, logprob: float, msg: StepReply, row: int | None) -> None:
        """An accepted token's PARTIAL (with its top logprobs when asked), and FINAL when it was the last."""
        top = texts = top_texts = None
        if seq.sampling.logprobs and msg.top_ids is not None and row is not None:
            n = seq.sampling.logprobs
            top = [[(int(t), finite_logprob(lp)) for t, lp in zip(msg.top_ids[row][:n], msg.top_logprobs[row][:n])]]
            texts, top_texts = [self._token_text(token)], [[self._token_text(t) for t, _ in top[0]]]
        self._reply(seq.client, Partial(id=seq.id, tokens=[token], text=text, logprobs=[logprob], top_logprobs=top,
                                        token_texts=texts, top_texts=top_texts,
                                        reasoning_open=seq.reasoning_open if len(seq.generated) == 1 else None))
        if seq.finish_reason:
            self._send_final(seq, seq.finish_reason)

    def _token_text(self, token: int) -> str:
        """One token on its own, special tokens included (a byte-level piece of a character: U+FFFD)."""
        return self.tokenizer.tokenizer.decode([token], skip_special_tokens=False)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.remove(seq)
        self._send_final(seq, reason)

    def _send_final(self, seq: Sequence, reason: str) -> None:
        """FINAL for a sequence that has left the scheduler."""
        self._reply(seq.client, Final(id=seq.id, finish_reason=reason, prompt_tokens=len(seq.prompt),
                                      completion_tokens=len(seq.generated)))
        self.stats.count("requests_cancelled_total" if reason == "cancelled" else "requests_finished_total")
        self.stats.observe("e2e_request_latency_seconds", time.monotonic() - seq.arrived_s)

    def _fail(self, seq: Sequence, message: str, status: int = 500) -> None:
        self.scheduler.remove(seq)
        self.stats.count("requests_failed_total")
        kind = "service_unavailable" if status == 503 else "server_error"
        self._reply(seq.client, Error(id=seq.id, message=message, type=kind, status=status))
