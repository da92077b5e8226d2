"""One request's state in the broker: prompt, sampling RNG, generated tokens, streamed text and the
stop rules. ``accept`` takes one sampled token and says what to stream and whether it finished."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from moebus.common.protocol import Sampling
from moebus.common.tokenizer import StreamDecoder


@dataclass
class Sequence:
    id: str
    client: bytes
    prompt: list[int]
    sampling: Sampling
    decoder: StreamDecoder
    stop_ids: frozenset
    max_context: int
    arrived_s: float = field(default_factory=time.monotonic)
    slot: int = -1
    fed: int = 0  # tokens whose keys and values are in the KV cache
    # a prompt chunk the worker holds part-done (workers/spanning_chunk.py): its length, sent again as
    # it was until the worker reports it done, and the draw its last row samples with (0: none held)
    held_feed: int = 0
    held_draw: float | None = None
    generated: list[int] = field(default_factory=list)
    text: str = ""
    emitted_chars: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    finish_reason: str | None = None
    embeds: np.ndarray | None = None  # (I, D) float32 image embeddings, one row per image token of the prompt
    embed_positions: np.ndarray | None = None  # (I,) int32 prompt positions of those image tokens, ascending
    reasoning_open: bool | None = None  # chat only: does the prompt end inside a <think> block?
    grammar: object | None = None  # structured output: a broker/grammar_state.py GrammarState
    # Qwen3-VL with images (broker/vision_qwen3vl.py): the prompt's M-RoPE positions (P, 3) int32, the
    # rope offset of every later token (its index + rope_delta), DeepStack rows (L, I, D) float32
    rope_positions: np.ndarray | None = None
    rope_delta: int = 0
    deepstack: np.ndarray | None = None

    def __post_init__(self):
        self.rng = np.random.default_rng(self.sampling.seed)
        self.hold_back = max((len(s) for s in self.sampling.stop), default=1) - 1
        self._prompt_ids: np.ndarray | None = None

    @property
    def is_prefilling(self) -> bool:
        return self.fed < len(self.prompt)

    def next_feed(self, budget: int) -> list[int]:
        """The tokens to feed this step: the next prompt chunk, or the last sampled token."""
        if self.held_feed:  # the same feed, whatever the budget: the worker continues what it holds
            return self.prompt[self.fed : self.fed + self.held_feed]
        if self.is_prefilling:
            return self.prompt[self.fed : self.fed + max(budget, 0)]
        return [self.generated[-1]]

    def draw(self) -> float:
        """The uniform draw for a step whose token counts: a held chunk's again, so that a chunk
        spanning steps samples with the draw it would have had in one."""
        return self.held_draw if self.held_draw is not None else float(self.rng.random())

    def accept(self, token: int, now: float) -> str:
        """Record a sampled token; returns the text to stream now (stop strings held back)."""
        self.first_token_s = self.first_token_s or now
        self.last_token_s = now
        self.generated.append(token)
        s = self.sampling
        if (token in self.stop_ids and not s.ignore_eos) or token in s.stop_token_ids:
            self.finish_reason = "stop"
        else:
            self.text += self.decoder.push(token)
            self._apply_stop_strings()
        if self.grammar is not None and self.grammar.observe(token, self.text) and self.finish_reason is None:
            self.finish_reason = "stop"  # the grammar is complete: nothing else may follow
            self.text += self.decoder.flush()
        if self.finish_reason is None and s.max_tokens is not None and len(self.generated) >= s.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is None and len(self.prompt) + len(self.generated) >= self.max_context:
            self.finish_reason = "length"
        if self.finish_reason == "length":
            self.text += self.decoder.flush()
        end = len(self.text) if self.finish_reason else max(self.emitted_chars, len(self.text) - self.hold_back)
        delta = self.text[self.emitted_chars : end]
        self.emitted_chars = end
        return delta

    def logit_entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The ids that this request's logit rules touch, as the last stage takes them (see
        cuda/kernels/penalties.py): ``counts`` is the id's count in the output (0: prompt only, -1: only
        biased); ``bias`` its logit bias."""
        s = self.sampling
        ids, counts = np.zeros(0, np.int32), np.zeros(0, np.int32)
        if s.has_penalties:
            if self._prompt_ids is None:  # the prompt never changes: its distinct ids once
                self._prompt_ids = np.unique(np.asarray(self.prompt, np.int32))
            out_ids, out_counts = np.unique(np.asarray(self.generated, np.int32), return_counts=True)
            ids = np.union1d(self._prompt_ids, out_ids).astype(np.int32)
            counts = np.zeros(len(ids), np.int32)
            counts[np.searchsorted(ids, out_ids)] = out_counts
        bias = np.zeros(len(ids), np.float32)
        if s.logit_bias:
            b_ids = np.array([t for t, _ in s.logit_bias], np.int32)
            b_values = np.array([b for _, b in s.logit_bias], np.float32)
            at = np.minimum(np.searchsorted(ids, b_ids), max(len(ids) - 1, 0))
            seen = (ids[at] == b_ids) if len(ids) else np.zeros(len(b_ids), bool)
            bias[at[seen]] = b_values[seen]
            ids = np.concatenate([ids, b_ids[~seen]])
            counts = np.concatenate([counts, np.full(int((~seen).sum()), -1, np.int32)])
            bias = np.concatenate([bias, b_values[~seen]])
        return ids, counts, bias

    def _apply_stop_strings(self) -> None:
        search_from = max(0, self.emitted_chars - self.hold_back)
        hits = [i for i in (self.text.find(stop, search_from) for stop in self.sampling.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.finish_reason = "stop"
