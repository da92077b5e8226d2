"""All stages of a model in this process, run in order: the in-process path behind the fidelity
tests, benchmarks and ``moebus generate --local``. The service does the same across processes."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from moebus.common.checkpoint import Checkpoint
from moebus.common.layer_split import split_layers
from moebus.common.vision_config import load_vision_config
from moebus.cuda.backends import make_backend
from moebus.workers import overlap
from moebus.workers.batch import StageOutput, StepBatch
from moebus.workers.experts import build_expert_cache
from moebus.workers.stage import Stage
from moebus.workers.prefetch import DEFAULT_SLOTS_PER_LAYER


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"


class LocalModel:
    def __init__(self, model_dir, device: str = "cpu", parts: list[int] | int = 1, num_slots: int = 8,
                 max_context: int = 1024, cache_fraction: float | None = None, elastic: bool = False,
                 policy: str = "freq", experts_dtype: str = "bf16", kv_dtype: str = "fp32",
                 prefetch_slots: int = DEFAULT_SLOTS_PER_LAYER, attention_dtype: str = "bf16",
                 lm_head_dtype: str = "bf16"):
        """``cache_fraction``: each stage's expert cache holds that share of its experts (None: all);
        ``policy``: its eviction and admission policy (eviction.POLICIES); ``experts_dtype``: bf16,
        fp8 or int4 (quantized at load); ``kv_dtype``: the KV cache's, bf16 or fp32 (fp32 here by default:
        the fidelity tests compare in-process logits with transformers' float32); ``prefetch_slots``:
        the next layer's experts copied ahead per layer where the cache is partial (0: none);
        ``attention_dtype``: the attention projections', bf16 or fp8 (common/fp8_dense.py);
        ``lm_head_dtype``: the lm_head's, bf16 or fp8 (the same)."""
        self.ckpt = Checkpoint(model_dir)
        self.backend = make_backend(device)
        self.stages = [Stage(self.ckpt, r, self.backend, num_slots, max_context, kv_dtype=kv_dtype,
                             attention_dtype=attention_dtype, lm_head_dtype=lm_head_dtype,
                             experts=build_expert_cache(self.ckpt, r, self.backend, fraction=cache_fraction,
                                                        elastic=elastic, policy=policy, experts_dtype=experts_dtype,
                                                        prefetch_slots=prefetch_slots))
                       for r in split_layers(self.ckpt.config.num_layers, parts)]
        self.vision_config = load_vision_config(model_dir)
        self._vision = None

    @property
    def vision(self):
        """The vision tower and projector (LLaVA checkpoints), loaded on first use on this backend."""
        from moebus.workers.vision_model import VisionModel, load_vision_weights

        if self.vision_config is None:
            raise ValueError(f"{self.ckpt.dir} has no vision tower")
        if self._vision is None:
            weights = load_vision_weights(self.ckpt.dir, self.vision_config)
            self._vision = VisionModel(self.vision_config, weights, self.backend)
        return self._vision

    def image_embeds(self, prompts: list[list[int]], images: list) -> dict:
        """StepBatch keywords that put each prompt's images (``(n, C, H, W)`` pixel values or None)
        at its image tokens, the prompts laid end to end as in one step."""
        hidden = self.ckpt.config.hidden_size
        image_token = self.vision_config.image_token_id if self.vision_config else None
        rows, embeds, offset = [], [], 0
        for prompt, pixels in zip(prompts, images):
            where = np.flatnonzero(np.asarray(prompt) == image_token) if image_token is not None else np.zeros(0, int)
            found = np.zeros((0, hidden), np.float32) if pixels is None or len(pixels) == 0 \
                else self.vision.encode(pixels).reshape(-1, hidden)
            if len(where) != len(found):
                raise ValueError(f"{len(where)} image tokens in the prompt, {len(found)} image embeddings")
            rows.append(where + offset)
            embeds.append(found)
            offset += len(prompt)
        return {"embeds": np.concatenate(embeds), "embed_rows": np.concatenate(rows).astype(np.int32)}

    def step(self, batch: StepBatch, want_logits: bool = False):
        hidden = None
        for stage in self.stages[:-1]:
            hidden = stage.forward(batch, hidden).hidden
        return self.stages[-1].forward(batch, hidden, want_logits=want_logits)

    def decode(self, batches: Iterable[StepBatch], launch_ahead: bool = True) -> Iterator[StageOutput]:
        """The outputs of ``batches``, steps of the same sequences (a prompt step may come first),
        each step after the first taking as its tokens the ids the step before sampled (its own
        ``tokens`` are not read). With ``launch_ahead``, one stage and captured graphs, a decode step
        is launched before the outputs of the step before are read (workers/overlap.py, as the
        service's worker does), so the host's work between steps runs while the GPU computes; the
        tokens and logprobs are those of the steps run one at a time."""
        if launch_ahead:
            return overlap.decode_ahead(self.stages[0], batches, self.step)
        return self._decode_in_turn(batches)

    def _decode_in_turn(self, batches: Iterable[StepBatch]) -> Iterator[StageOutput]:
        tokens = None
        for batch in batches:
            out = self.step(batch if tokens is None else overlap.fed(batch, tokens))
            tokens = out.tokens
            yield out

    def prefill_logits(self, prompts: list[list[int]], images: list | None = None) -> np.ndarray:
        """Last-position logits (S, V) of a batch of prompts of any lengths, one slot each;
        ``images``: per prompt, pixel values for its image tokens (or None)."""
        embeds = self.image_embeds(prompts, images) if images is not None else {}
        batch = StepBatch(slots=np.arange(len(prompts)), starts=np.zeros(len(prompts)),
                          lengths=[len(p) for p in prompts], tokens=np.concatenate(prompts), **embeds)
        return self.step(batch, want_logits=True).logits

    def generate(self, prompt: list[int], max_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop_ids=(), slot: int = 0,
                 images: np.ndarray | None = None) -> Generation:
        """``images``: (n, C, H, W) pixel values for the prompt's n images' tokens."""
        rng = np.random.default_rng(seed)
        out = Generation()
        if max_tokens <= 0:
            return out
        sampling = dict(temperature=[temperature], top_k=[top_k], top_p=[top_p])
        embeds = self.image_embeds([list(prompt)], [images]) if images is not None else {}

        def batches():  # the prompt, then one token a step (its id: the one the step before sampled)
            yield StepBatch(slots=[slot], starts=[0], lengths=[len(prompt)], tokens=prompt, u=[rng.random()],
                            **sampling, **embeds)
            for i in range(max_tokens - 1):
                yield StepBatch(slots=[slot], starts=[len(prompt) + i], lengths=[1], tokens=[0], u=[rng.random()],
                                **sampling)

        for result in self.decode(batches()):
            token = int(result.tokens[0])
            out.tokens.append(token)
            out.logprobs.append(float(result.logprobs[0]))
            if token in stop_ids:
                out.finish_reason = "stop"
                break
        return out
