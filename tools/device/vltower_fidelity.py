"""Qwen3-VL-MoE on cuda with its tower on the tensor cores, against transformers (tools/device/vltower.sh).

The tests' tiny checkpoints (tests/vision/qwen3vl_models.py) are float32 with images of at most 8 x 8
patches, so on a GPU their tower runs the tiled kernels. Here the same model is saved in bf16
(transformers runs it in float32 from those weights) with a max_pixels that lets images reach ~400
patches (~100 merged rows): every product of the tower, its attention and the mergers take the
tensor-core path (threshold 65 rows), and so does the prompt's prefill. One image, then two of
different sizes: greedy tokens equal, logprobs within 1e-3 (the fidelity bar); the patches are ours,
fed to both, so the preprocessing is not what is compared here."""
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MAX_PIXELS = 192 * 192
NUM_TOKENS = 8


def _allow_larger_images(model_dir: Path) -> None:
    path = model_dir / "preprocessor_config.json"
    raw = json.loads(path.read_text())
    raw["size"] = {**raw.get("size", {}), "longest_edge": MAX_PIXELS}
    if "max_pixels" in raw:
        raw["max_pixels"] = MAX_PIXELS
    path.write_text(json.dumps(raw, indent=2))


def images() -> list:
    """Two images of different sizes, each ~400 patches once preprocessed (MAX_PIXELS)."""
    from PIL import Image

    rng = np.random.default_rng(1)
    return [Image.fromarray(rng.integers(0, 256, (170, 150, 3), dtype=np.uint8)),
            Image.fromarray(rng.integers(0, 256, (130, 190, 3), dtype=np.uint8))]


def models(tmp: Path, device: str = "cuda", vision: dict | None = None):
    """(checkpoint dir, transformers' float32 model, ours on ``device``) of a bf16 Qwen3-VL-MoE whose
    images may reach ~400 patches; ``vision``: its tower's config overrides."""
    import torch
    import transformers

    from moebus.workers.qwen3vl_local import Qwen3VLLocal
    from tests.vision.qwen3vl_models import make_hf_qwen3vl

    d = make_hf_qwen3vl(tmp / "hf", dtype="bf16", vision=vision)
    _allow_larger_images(d)
    hf = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return d, hf, Qwen3VLLocal(d, device=device, num_slots=2, max_context=512)


def prompt(ours, d: Path, pictures: list):
    """(token ids, ImagePatches) of a chat with ``pictures`` and the check's question."""
    from moebus.common.tokenizer import TextTokenizer
    from qwen3vl_check import TEXT

    content = [{"type": "image"}] * len(pictures) + [{"type": "text", "text": TEXT}]
    return ours.prepare(TextTokenizer(d).encode_chat([{"role": "user", "content": content}]), pictures)


def main() -> bool:
    from qwen3vl_check import _hf_greedy

    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        d, hf, ours = models(Path(tmp))
        tc = getattr(ours.lm.backend, "tensor_cores", None)
        for n in (1, 2):
            ids, patches = prompt(ours, d, images()[:n])
            merged = [p.grid_h * p.grid_w // 4 for p in patches]
            on_tc = tc is not None and min(merged) >= tc.min_rows and ours.vision.patch_weight.dtype == np.uint16
            out = ours.generate(ids, NUM_TOKENS, patches)
            ref_tokens, ref_logprobs = _hf_greedy(hf, ids, patches, NUM_TOKENS)
            diff = float(np.abs(np.array(out.logprobs) - ref_logprobs).max())
            good = out.tokens == ref_tokens and diff <= 1e-3 and on_tc
            ok &= good
            print(f"tower fidelity, {n} image(s) of {[(p.grid_h, p.grid_w) for p in patches]} patches "
                  f"({merged} merged rows, tensor cores: {on_tc}), prompt {len(ids)} tokens: tokens "
                  f"{'equal' if out.tokens == ref_tokens else 'DIFFER'}, max |logprob diff| {diff:.2e} "
                  f"{'ok' if good else 'FAIL'}")
    return ok


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
