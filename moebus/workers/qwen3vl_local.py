"""A Qwen3-VL-MoE model in this process (the fidelity tests, ``moebus bench``): LocalModel's stages
plus the vision tower, with what a service step carries for it (image embeddings, M-RoPE positions,
DeepStack rows) built the way the broker builds them."""
from __future__ import annotations

import numpy as np

from moebus.common.qwen3vl_config import load_raw, parse_qwen3_vision_config
from moebus.common.qwen3vl_image_processor import Qwen3VLImageProcessor
from moebus.common.qwen3vl_positions import expand_image_pads, rope_index, step_rope_positions
from moebus.workers.batch import StepBatch
from moebus.workers.local import Generation, LocalModel


class Qwen3VLLocal:
    def __init__(self, model_dir, device: str = "cpu", num_slots: int = 4, max_context: int = 1024, **kwargs):
        self.lm = LocalModel(model_dir, device=device, num_slots=num_slots, max_context=max_context, **kwargs)
        self.vision_config = parse_qwen3_vision_config(load_raw(model_dir), str(model_dir))
        self.processor = Qwen3VLImageProcessor.from_dir(model_dir)
        self.processor.check_matches(self.vision_config)
        self._vision = None

    @property
    def vision(self):
        from moebus.workers.qwen3vl_vision import Qwen3VisionModel
        from moebus.workers.qwen3vl_weights import load_qwen3vl_weights

        if self._vision is None:
            weights = load_qwen3vl_weights(self.lm.ckpt.dir, self.vision_config)
            self._vision = Qwen3VisionModel(self.vision_config, weights, self.lm.backend)
        return self._vision

    def prepare(self, ids: list[int], images: list) -> tuple[list[int], list]:
        """(expanded prompt ids, ImagePatches per image) for a rendered prompt and its PIL images."""
        patches = [self.processor.preprocess(image) for image in images]
        counts = [p.grid_h * p.grid_w // self.vision_config.merge_size ** 2 for p in patches]
        return expand_image_pads(ids, self.vision_config.image_token_id, counts), patches

    def sequence_inputs(self, prompt: list[int], images: list) -> dict:
        """One prompt's image arrays: embeds (I, D), rows (I,), deepstack (L, I, D), positions (P, 3), delta."""
        cfg = self.vision_config
        grids = [(p.grid_h, p.grid_w) for p in images]
        positions, delta = rope_index(prompt, cfg.image_token_id, grids, cfg.merge_size)
        rows = np.flatnonzero(np.asarray(prompt) == cfg.image_token_id).astype(np.int32)
        if images:
            embeds, deepstack = self.vision.encode_images(images)
        else:
            hidden = self.lm.ckpt.config.hidden_size
            embeds, deepstack = np.zeros((0, hidden), np.float32), np.zeros((len(cfg.deepstack_layers), 0, hidden),
                                                                            np.float32)
        return dict(embeds=embeds, rows=rows, deepstack=deepstack, positions=positions, delta=delta)

    def step_kwargs(self, prompts: list[list[int]], inputs: list[dict]) -> dict:
        """StepBatch keywords for prompts laid end to end (a whole prefill each)."""
        offsets = np.cumsum([0] + [len(p) for p in prompts[:-1]])
        rows = np.concatenate([i["rows"] + o for i, o in zip(inputs, offsets)]).astype(np.int32)
        return dict(embeds=np.concatenate([i["embeds"] for i in inputs]), embed_rows=rows,
                    rope_positions=np.concatenate([i["positions"] for i in inputs]),
                    deepstack=np.concatenate([i["deepstack"] for i in inputs], axis=1), deepstack_rows=rows)

    def prefill_logits(self, prompts: list[list[int]], images: list[list]) -> np.ndarray:
        """Last-position logits (S, V); ``images``: per prompt, its ImagePatches (possibly none)."""
        inputs = [self.sequence_inputs(p, i) for p, i in zip(prompts, images)]
        batch = StepBatch(slots=np.arange(len(prompts)), starts=np.zeros(len(prompts)),
                          lengths=[len(p) for p in prompts], tokens=np.concatenate(prompts),
                          **self.step_kwargs(prompts, inputs))
        return self.lm.step(batch, want_logits=True).logits

    def generate(self, prompt: list[int], max_tokens: int, images: list, slot: int = 0) -> Generation:
        """Greedy: the prefill with its images, then one token per step at the sequence's own rope offset."""
        inputs = self.sequence_inputs(prompt, images)
        out = Generation()
        tokens, start = list(prompt), 0
        while len(out.tokens) < max_tokens:
            extra = self.step_kwargs([prompt], [inputs]) if start == 0 else \
                {"rope_positions": step_rope_positions(None, inputs["delta"], start, 1)}
            result = self.lm.step(StepBatch(slots=[slot], starts=[start], lengths=[len(tokens)], tokens=tokens,
                                            temperature=[0.0], **extra))
            out.tokens.append(int(result.tokens[0]))
            out.logprobs.append(float(result.logprobs[0]))
            start += len(tokens)
            tokens = [out.tokens[-1]]
        return out
