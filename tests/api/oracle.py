"""An independent next-token oracle for the api tests: the tiny model's logits from moebus' in-process
path, adjusted by transformers' logits processors or OpenAI's documented formula (never by moebus'
own rules), then greedy or the allowed set of a sampled token."""
from __future__ import annotations

from collections import Counter

import numpy as np


def openai_penalties(logits: np.ndarray, output: list[int], frequency: float, presence: float) -> np.ndarray:
    """mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence, per token as OpenAI writes it."""
    counts = Counter(output)
    out = logits.astype(np.float64).copy()
    for j, c in counts.items():
        out[j] -= c * frequency + (1.0 if c > 0 else 0.0) * presence
    return out


def hf_process(processor, logits: np.ndarray, history: list[int]) -> np.ndarray:
    import torch

    scores = torch.tensor(np.asarray(logits, np.float32)[None])
    return processor(torch.tensor([history], dtype=torch.long), scores).numpy()[0].astype(np.float64)


class Oracle:
    def __init__(self, model_dir, max_context: int = 256):
        from moebus.workers.local import LocalModel

        self.model = LocalModel(model_dir, max_context=max_context)

        self._logits: dict[tuple, np.ndarray] = {}

    def logits(self, ids: list[int]) -> np.ndarray:
        key = tuple(ids)
        if key not in self._logits:  # the tests ask for the same prefixes again and again
            self._logits[key] = self.model.prefill_logits([list(ids)])[0]
        return self._logits[key]

    def greedy(self, prompt: list[int], num_tokens: int, frequency=0.0, presence=0.0, repetition=1.0,
               logit_bias: dict[int, float] | None = None) -> list[int]:
        """Greedy tokens in vLLM's order: bias, repetition (transformers), frequency and presence (OpenAI)."""
        from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

        out: list[int] = []
        for _ in range(num_tokens):
            x = self.logits(prompt + out)
            if logit_bias:
                x = hf_process(SequenceBiasLogitsProcessor({(t,): b for t, b in logit_bias.items()}), x, prompt + out)
            if repetition != 1.0:
                x = hf_process(RepetitionPenaltyLogitsProcessor(repetition), x, prompt + out)
            x = openai_penalties(x, out, frequency, presence)
            out.append(int(np.argmax(x)))
        return out
