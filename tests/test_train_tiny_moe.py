"""tools/train_tiny_moe.py at toy size: a few seconds of training on this repository's docs lower
the held-out loss well below the random model's, and what it saves (bf16 by save_pretrained, and
its FP8 copy in Qwen's format) loads in moebus and matches transformers on held-out prompts."""
import importlib.util
import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SHAPES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128)


def _tool():
    spec = importlib.util.spec_from_file_location("train_tiny_moe", ROOT / "tools" / "train_tiny_moe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    tool = _tool()
    log = tool.run(root / "bf16", seconds=300, threads=1, shapes=SHAPES, vocab_size=384, corpus=[str(ROOT / "docs")],
                   seq_len=64, batch_size=8, max_steps=150, fp8=root / "fp8")
    return tool, root, log


def test_training_lowers_the_held_out_loss(trained):
    _, root, log = trained
    assert log["steps"] > 0 and log["curve"]
    assert abs(log["held_out_loss_initial"] - math.log(384)) < 0.5  # random weights: about uniform
    assert log["held_out_loss_final"] < log["held_out_loss_initial"] - 1.0
    assert json.loads((root / "bf16" / "train_log.json").read_text())["steps"] == log["steps"]
    config = json.loads((root / "fp8" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"


@pytest.mark.parametrize("name", ["bf16", "fp8"])
def test_the_checkpoints_match_transformers(trained, name):
    tool, root, _ = trained
    prompts = json.loads((root / name / "held_out_prompts.json").read_text())[:2]
    r = tool.check_against_transformers(root / name, prompts, num_tokens=16, fp8=name == "fp8")
    assert r["max_logprob_diff"] < 1e-3 and r["greedy_equal"]


def test_a_corpus_of_fewer_files_than_the_split_still_holds_one_out(tmp_path):
    # docs/ once held 10 files under the size limit and then 9 (performance.md passed it): every 10th file held
    # none out, and the held-out loss had no text; now the last file is held out
    files = []
    for i in range(9):
        files.append(tmp_path / f"{i}.md")
        files[-1].write_text(f"text {i}")
    train, held = _tool().split_files(files, 10)
    assert held == ["text 8"] and train == [f"text {i}" for i in range(8)]
    train, held = _tool().split_files(files, 3)  # every 3rd, as before
    assert held == ["text 2", "text 5", "text 8"]
