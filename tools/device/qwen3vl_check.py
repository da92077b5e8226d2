"""Qwen3-VL-MoE on cuda (tools/device/qwen3vl_h200.sh):

1. fidelity: a tiny Qwen3VLMoe written by transformers (or, without torch on the machine, by
   ``init-model --arch qwen3_vl_moe``): one image, two images of different sizes and text only;
   greedy tokens and log-probabilities on cuda against transformers (else against moebus on cpu);
2. the Qwen3-VL-30B-A3B tower (depth 27, hidden 1152, patch 16, bf16, random weights): the warm
   encode of one 1024 x 768 image, median of 10, tower + merger + DeepStack mergers."""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moebus.common.tokenizer import TextTokenizer  # noqa: E402
from moebus.workers.qwen3vl_local import Qwen3VLLocal  # noqa: E402

TEXT = "What is in the picture?"


def _images():
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (40, 70, 3), dtype=np.uint8)),
            Image.fromarray(rng.integers(0, 256, (90, 50, 3), dtype=np.uint8))]


def _model(tmp: Path) -> tuple[Path, object]:
    try:
        import torch
        import transformers
        from tests.vision.qwen3vl_models import make_hf_qwen3vl

        d = make_hf_qwen3vl(tmp / "hf")
        hf = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        return d, hf
    except ImportError as e:
        print(f"no transformers here ({e}): cuda is compared with moebus on cpu")
        from moebus.common.tiny_model import init_model

        return init_model(tmp / "init", "qwen3_vl_moe", "tiny", dtype="f32"), None


def _hf_greedy(hf, ids: list[int], patches, num_tokens: int):
    import torch

    kwargs = {}
    if patches:
        kwargs = dict(pixel_values=torch.tensor(np.concatenate([p.patches for p in patches])),
                      image_grid_thw=torch.tensor([[1, p.grid_h, p.grid_w] for p in patches]))
    inp = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(input_ids=inp, attention_mask=torch.ones_like(inp), max_new_tokens=num_tokens,
                          mm_token_type_ids=(inp == hf.config.image_token_id).int(), do_sample=False,
                          output_logits=True, return_dict_in_generate=True, **kwargs)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [float(torch.log_softmax(s[0], -1)[t]) for s, t in zip(out.logits, tokens)]


def fidelity(num_tokens: int = 8) -> bool:
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        d, hf = _model(Path(tmp))
        cuda = Qwen3VLLocal(d, device="cuda", num_slots=2, max_context=256)
        cpu = None if hf is not None else Qwen3VLLocal(d, device="cpu", num_slots=2, max_context=256)
        for n in (1, 2, 0):
            content = [{"type": "image"}] * n + [{"type": "text", "text": TEXT}]
            ids, patches = cuda.prepare(TextTokenizer(d).encode_chat([{"role": "user", "content": content}]),
                                        _images()[:n])
            ours = cuda.generate(ids, num_tokens, patches)
            if hf is not None:
                ref_tokens, ref_logprobs = _hf_greedy(hf, ids, patches, num_tokens)
            else:
                ref = cpu.generate(ids, num_tokens, patches)
                ref_tokens, ref_logprobs = ref.tokens, ref.logprobs
            diff = float(np.abs(np.array(ours.logprobs) - ref_logprobs).max())
            good = ours.tokens == ref_tokens and diff <= 1e-3
            ok &= good
            print(f"fidelity {n} image(s): tokens {'equal' if ours.tokens == ref_tokens else 'DIFFER'}, "
                  f"max |logprob diff| {diff:.2e} {'ok' if good else 'FAIL'}")
    return ok


def tower_encode(repeats: int = 10, preset: str = "a3b", device: str = "cuda") -> None:
    from PIL import Image

    from moebus.common.qwen3vl_config import parse_qwen3_vision_config
    from moebus.common.qwen3vl_image_processor import Qwen3VLImageProcessor
    from moebus.common.qwen3vl_tiny import preprocessor_config, qwen3vl_config, vision_tensors
    from moebus.common.tiny_model import _Random, hf_config
    from moebus.cuda.backends import make_backend
    from moebus.cuda.dtypes import f32_to_bf16
    from moebus.workers.qwen3vl_vision import Qwen3VisionModel

    raw = qwen3vl_config(hf_config("qwen3_moe", preset), preset, dict(image_token_id=151655))
    cfg = parse_qwen3_vision_config(raw)
    weights = {k[len("model.visual."):]: f32_to_bf16(v) for k, v in vision_tensors(raw, _Random(1, False)).items()}
    backend = make_backend(device)
    model = Qwen3VisionModel(cfg, weights, backend)
    image = Qwen3VLImageProcessor(preprocessor_config(raw, preset)).preprocess(
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (768, 1024, 3), dtype=np.uint8)))
    started = time.perf_counter()
    model.encode(image.patches, image.grid_h, image.grid_w)
    print(f"tower: {cfg.depth} blocks x {cfg.hidden_size}, {model.device_bytes / 2**20:.0f} MiB of weights; "
          f"1024x768 px -> {image.grid_h}x{image.grid_w} patches, {image.grid_h * image.grid_w // 4} tokens; "
          f"first encode (compiles) {time.perf_counter() - started:.1f} s")
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        model.encode(image.patches, image.grid_h, image.grid_w)  # returns host arrays: synchronized
        times.append(time.perf_counter() - started)
    print(f"tower warm encode of a 1024x768 image: median {1e3 * np.median(times):.1f} ms, "
          f"min {1e3 * min(times):.1f} ms over {repeats} (target <= 30 ms)")


if __name__ == "__main__":
    good = fidelity()
    tower_encode()
    sys.exit(0 if good else 1)
