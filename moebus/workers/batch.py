"""One step's work for a stage: S sequences, each with its KV slot, the position of its first new
token and the number of new tokens (a whole prompt at prefill, 1 at decode); T = sum of lengths."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class StepBatch:
    slots: np.ndarray  # (S,) int32 KV cache slot per sequence
    starts: np.ndarray  # (S,) int32 position of each sequence's first new token
    lengths: np.ndarray  # (S,) int32 new tokens per sequence
    tokens: np.ndarray | None = None  # (T,) int32, for the first stage
    temperature: np.ndarray | None = None  # (S,) float32, for the last stage; <= 0: greedy
    top_k: np.ndarray | None = None  # (S,) int32, 0: off
    top_p: np.ndarray | None = None  # (S,) float32, 1: off
    u: np.ndarray | None = None  # (S,) float32 uniform draws for sampling
    top_logprobs: int = 0  # return the n most likely ids per sequence too
    extras: dict = field(default_factory=dict)

    def __post_init__(self):
        self.slots = np.asarray(self.slots, dtype=np.int32)
        self.starts = np.asarray(self.starts, dtype=np.int32)
        self.lengths = np.asarray(self.lengths, dtype=np.int32)
        if self.tokens is not None:
            self.tokens = np.asarray(self.tokens, dtype=np.int32)

    @property
    def num_seqs(self) -> int:
        return len(self.slots)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def token_slots(self) -> np.ndarray:
        return np.repeat(self.slots, self.lengths).astype(np.int32)

    def token_positions(self) -> np.ndarray:
        offsets = np.arange(self.num_tokens) - np.repeat(np.cumsum(self.lengths) - self.lengths, self.lengths)
        return (np.repeat(self.starts, self.lengths) + offsets).astype(np.int32)

    def last_token_index(self) -> np.ndarray:
        return (np.cumsum(self.lengths) - 1).astype(np.int32)

    def sampling_arrays(self):
        s = self.num_seqs
        temperature = np.zeros(s, np.float32) if self.temperature is None else np.asarray(self.temperature, np.float32)
        top_k = np.zeros(s, np.int32) if self.top_k is None else np.asarray(self.top_k, np.int32)
        top_p = np.ones(s, np.float32) if self.top_p is None else np.asarray(self.top_p, np.float32)
        u = np.zeros(s, np.float32) if self.u is None else np.asarray(self.u, np.float32)
        return temperature, top_k, top_p, u
