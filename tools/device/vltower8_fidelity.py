"""vltower_fidelity.py's check (a bf16 Qwen3-VL-MoE whose tower runs on the tensor cores, images of
~400 patches, greedy tokens and logprobs against float32 transformers, bar 1e-3), on a wider and
deeper tower than the tests' (WIDER: head dim 72 as Qwen3-VL-30B-A3B's, 8 blocks), at each of the
tower's precisions (tools/device/vltower8.sh): the images' attention split / split_scores / bf16
(flash_attention.IMAGE_PRECISION) and the tower's products split / bf16 (qwen3vl_vision.GEMM_PRECISION),
one model, transformers run once per prompt. Says which precisions meet the bar."""
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

NUM_TOKENS = 8
DEVICE = os.environ.get("VLTOWER8_DEVICE", "cuda")  # cpu: a dry run of the script (the precisions then do nothing)
WIDER = dict(depth=8, hidden_size=288, intermediate_size=1152, num_heads=4, deepstack_visual_indexes=[1, 4, 7])
CONFIGS = [("split", ""), ("split_scores", ""), ("bf16", ""), ("split", "bf16"), ("bf16", "bf16")]


def main() -> bool:
    from moebus.cuda.kernels import flash_attention
    from moebus.workers import qwen3vl_vision
    from qwen3vl_check import _hf_greedy
    from vltower_fidelity import images, models, prompt

    default_ok = True
    with tempfile.TemporaryDirectory() as tmp:
        d, hf, ours = models(Path(tmp), DEVICE, WIDER)
        tc = getattr(ours.lm.backend, "tensor_cores", None)
        prompts = []
        for n in (1, 2):
            ids, patches = prompt(ours, d, images()[:n])
            prompts.append((n, ids, patches, _hf_greedy(hf, ids, patches, NUM_TOKENS)))
        print(f"tower: head dim {ours.vision_config.head_dim}, weights {ours.vision.patch_weight.dtype}, tensor "
              f"cores from {tc.min_rows if tc else None} rows; images {[(p.grid_h, p.grid_w) for p in prompts[1][2]]}")
        for attention, products in CONFIGS:
            flash_attention.IMAGE_PRECISION, qwen3vl_vision.GEMM_PRECISION = attention, products
            ours.vision.graph.close()
            worst, same = 0.0, True
            for n, ids, patches, (ref_tokens, ref_logprobs) in prompts:
                out = ours.generate(ids, NUM_TOKENS, patches)
                worst = max(worst, float(np.abs(np.array(out.logprobs) - ref_logprobs).max()))
                same &= out.tokens == ref_tokens
            good = same and worst <= 1e-3
            default_ok &= good or (attention, products) != CONFIGS[0]
            print(f"fidelity, attention {attention}, products {products or 'split'}: tokens "
                  f"{'equal' if same else 'DIFFER'}, max |logprob diff| {worst:.2e} {'meets' if good else 'misses'} "
                  f"the 1e-3 bar")
    return default_ok


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
