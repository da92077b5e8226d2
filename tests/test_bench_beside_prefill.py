"""`moebus bench decode --beside-prefill N` on the cpu device through a real private broker: 8 greedy
streams decode, one prompt of N tokens prefills among them, and each N gets the streams' gaps before
and during, the prompt's first token and the broker's steps in both windows. With
``max_prefill_tokens_beside_decode`` set, the same prompt is read in more, smaller steps."""
import json
import math

import pytest

from moebus.bench.beside_prefill import STREAMS, prompt_lengths
from moebus.bench.decode import main

STEP_TOKENS = 24  # a step's budget: STREAMS decode rows + 16 prompt tokens


def _figures(tiny_model, capsys, n: int) -> dict:
    assert main(["--model", str(tiny_model), "--batch", "1", "--tokens", "2", "--repeats", "1", "--prompt-tokens", "4",
                 "--no-service", "--beside-prefill", f"8,{n}", "--json"]) == 0
    return json.loads(capsys.readouterr().out.splitlines()[-1])


def test_gaps_before_and_while_a_long_prompt_prefills(tiny_model, capsys, monkeypatch):
    monkeypatch.setenv("MOEBUS_MAX_STEP_TOKENS", str(STEP_TOKENS))
    n = 64
    plain = _figures(tiny_model, capsys, n)
    assert plain["beside_max_step_tokens"] == STEP_TOKENS and plain["beside_max_prefill_tokens_beside_decode"] is None
    for length in (8, n):
        f = {k.removeprefix(f"beside{length}_"): v for k, v in plain.items() if k.startswith(f"beside{length}_")}
        assert 0 < f["gap_before_ms"] and 0 < f["gap_during_ms"] <= f["gap_during_max_ms"]
        assert 0 < f["gap_during_mean_ms"] <= f["gap_during_max_ms"]
        assert f["gap_ratio"] == pytest.approx(f["gap_during_ms"] / f["gap_before_ms"], rel=1e-2)
        assert f["gaps_during"] >= STREAMS  # each stream's gap that the window cut into, at least
        assert f["prefill_tok_s"] == pytest.approx(length / f["first_token_s"], rel=1e-2)
        assert f["before_steps"] >= 16 and f["before_step_ms"] > 0  # BEFORE_GAPS decode steps, at least
    # the prompt is read 16 tokens a step beside the 8 decode rows
    assert plain[f"beside{n}_during_steps"] >= math.ceil(n / (STEP_TOKENS - STREAMS))

    monkeypatch.setenv("MOEBUS_MAX_PREFILL_TOKENS_BESIDE_DECODE", "4")
    capped = _figures(tiny_model, capsys, n)
    assert capped["beside_max_prefill_tokens_beside_decode"] == 4
    assert capped[f"beside{n}_during_steps"] >= n // 4  # 4 prompt tokens a step beside the decode rows
    assert capped[f"beside{n}_during_steps"] > plain[f"beside{n}_during_steps"]


def test_prompt_lengths_are_positive_integers():
    assert prompt_lengths("2048,8192") == [2048, 8192]
    for bad in ("", "0", "8,x", "-4"):
        with pytest.raises(Exception, match="at least one token"):
            prompt_lengths(bad)
