"""`moebus bench quality`: the comparison arithmetic, and a short run on a tiny FP8 checkpoint whose
fp8 experts are the very values its bf16 reference rounds (so they must agree closely)."""
import json

import numpy as np
import pytest

from moebus.bench.quality import HELD_OUT, _entropy, compare_step, main, measure
from moebus.common.tiny_model import init_model


def test_compare_step_agreement_and_kl():
    ref = np.log(np.array([[0.7, 0.2, 0.1], [0.5, 0.25, 0.25]]))
    test = np.log(np.array([[0.6, 0.3, 0.1], [0.2, 0.7, 0.1]]))
    agree, kl = compare_step(ref, test)
    assert agree.tolist() == [True, False]
    expected = [0.7 * np.log(0.7 / 0.6) + 0.2 * np.log(0.2 / 0.3),
                0.5 * np.log(0.5 / 0.2) + 0.25 * np.log(0.25 / 0.7) + 0.25 * np.log(0.25 / 0.1)]
    np.testing.assert_allclose(kl, expected, rtol=1e-9)
    assert compare_step(ref, ref + 3.0)[1].max() < 1e-12  # a shift of the logits changes nothing


def test_entropy_of_the_next_token_distribution():
    logits = np.array([[0.0, 0.0, 0.0, 0.0], [50.0, 0.0, 0.0, 0.0], np.log([0.5, 0.25, 0.25, 1e-30])])
    np.testing.assert_allclose(_entropy(logits), [np.log(4), 0.0, 1.5 * np.log(2)], atol=1e-9)


def test_fp8_checkpoint_quality_run(tmp_path, capsys):
    model = init_model(tmp_path / "fp8", experts_dtype="fp8")
    r = measure(str(model), "fp8", steps=6, num_prompts=3)
    assert r["comparisons"] == 18 and r["expert_bytes_ratio"] > 1.9
    assert r["top1_agreement"] == 1.0 and r["mean_kl"] < 1e-3  # the same values, bf16-rounded or not
    assert 0 < r["ref_entropy"] < np.log(384) and 0 < r["ref_distinct_tokens"] <= 1
    assert main(["--model", str(model), "--experts-dtype", "int4", "--steps", "3", "--prompts", "2", "--json"]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert row["experts_dtype"] == "int4" and row["comparisons"] == 6 and 0 <= row["top1_agreement"] <= 1


def test_follow_text_feeds_the_text_not_the_greedy_tokens(tmp_path):
    model = init_model(tmp_path / "fp8", experts_dtype="fp8")
    text = " ".join(HELD_OUT)
    greedy = measure(str(model), "fp8", steps=5, num_prompts=2, texts=[text])
    follow = measure(str(model), "fp8", steps=5, num_prompts=2, texts=[text], follow_text=True)
    assert follow["follow"] == "text" and greedy["follow"] == "greedy" and follow["comparisons"] == 10
    assert follow["ref_entropy"] != greedy["ref_entropy"]  # other tokens fed after the prompt
    assert follow["top1_agreement"] == 1.0 and follow["mean_kl"] < 1e-3
    with pytest.raises(ValueError, match="needs texts of"):
        measure(str(model), "fp8", steps=5, num_prompts=1, texts=["too short"], follow_text=True)


def test_fp8_attention_quality_run(tmp_path):
    """An FP8 checkpoint's own q/k/v/o codes against their bf16 rounding: close, not identical."""
    model = init_model(tmp_path / "fp8", experts_dtype="fp8")
    r = measure(str(model), "fp8", steps=4, num_prompts=2, attention_dtype="fp8")
    assert r["attention_dtype"] == "fp8" and r["comparisons"] == 8
    assert r["top1_agreement"] == 1.0 and 0 < r["mean_kl"] < 1e-3


def test_fp8_lm_head_quality_run(tmp_path, capsys):
    """bf16 experts and attention, the lm_head quantized at load: against the bf16 model, close."""
    model = init_model(tmp_path / "bf16")
    assert main(["--model", str(model), "--experts-dtype", "bf16", "--lm-head-dtype", "fp8", "--steps", "4",
                 "--prompts", "2", "--json"]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert row["lm_head_dtype"] == "fp8" and row["attention_dtype"] == "bf16" and row["comparisons"] == 8
    assert row["top1_agreement"] >= 0.75 and 0 < row["mean_kl"] < 1e-2


@pytest.mark.parametrize("content, says", [(None, "FileNotFoundError"), (b"not json", "JSONDecodeError"),
                                           (b"\xff\xfe", "UnicodeDecodeError"), (b'"one text"', "a non-empty JSON list"),
                                           (b"[]", "a non-empty JSON list"), (b'["a", 3]', "a non-empty JSON list")])
def test_a_bad_prompt_file_ends_with_a_message_naming_it(tmp_path, content, says):
    path = tmp_path / "prompts.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as ended:
        main(["--prompt-file", str(path), "--steps", "1"])
    assert str(path) in str(ended.value) and says in str(ended.value)
