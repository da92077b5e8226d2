"""A Qwen3-VL-MoE step on the cuda device (numba's simulator here) against the cpu device: M-RoPE
positions that differ per axis, image embeddings and DeepStack rows, prefill then a decode token at
the sequence's rope offset; the language model split over two stages (DeepStack layers on both)."""
import numpy as np
import pytest

from moebus.common.qwen3vl_positions import expand_image_pads, rope_index, step_rope_positions
from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel
from tests.cuda.test_e2e import init_micro


@pytest.fixture(scope="module")
def micro_qwen3vl(tmp_path_factory):
    return init_micro(tmp_path_factory, arch="qwen3_vl_moe", folder="micro-vl")


def test_mrope_and_deepstack_steps_match_the_cpu_device(micro_qwen3vl):
    image = 7
    prompt = expand_image_pads([5, image, 9, 12], image, [4])  # one image of 4 x 4 patches: 2 x 2 tokens
    positions, delta = rope_index(prompt, image, [(4, 4)], 2)
    rows = np.flatnonzero(np.asarray(prompt) == image).astype(np.int32)
    rng = np.random.default_rng(0)
    images = dict(embeds=rng.standard_normal((4, 32), dtype=np.float32), embed_rows=rows,
                  deepstack=rng.standard_normal((2, 4, 32), dtype=np.float32), deepstack_rows=rows)
    prefill = StepBatch(slots=[0], starts=[0], lengths=[len(prompt)], tokens=prompt, rope_positions=positions, **images)
    decode = StepBatch(slots=[0], starts=[len(prompt)], lengths=[1], tokens=[3],
                       rope_positions=step_rope_positions(positions, delta, len(prompt), 1))
    out = {}
    for device in ("cpu", "cuda"):
        model = LocalModel(micro_qwen3vl, device=device, parts=2, max_context=32)
        out[device] = [model.step(batch, want_logits=True).logits for batch in (prefill, decode)]
    for cpu, cuda in zip(out["cpu"], out["cuda"]):
        np.testing.assert_allclose(cuda, cpu, atol=1e-4)
    assert delta < 0 and np.abs(out["cpu"][0]).max() > 1.0
