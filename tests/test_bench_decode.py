"""`moebus bench decode --cache-mib`: one cache size in MiB whatever the experts' dtype."""
import json

import pytest

from moebus.bench.decode import cache_fraction_of_mib, experts_mib, main


def _run(model, *args) -> None:
    assert main(["--model", str(model), "--batch", "1", "--tokens", "2", "--repeats", "1", "--prompt-tokens", "4",
                 "--no-service", "--json", *args]) == 0


def test_cache_mib_holds_the_same_mib_and_more_quantized_experts(tiny_model, capsys):
    assert cache_fraction_of_mib(str(tiny_model), "bf16", 1e9) == 1.0
    bf16_mib = experts_mib(str(tiny_model), "bf16")
    rows = {}
    for dtype in ("bf16", "fp8", "int4"):
        _run(tiny_model, "--experts-dtype", dtype, "--cache-mib", str(bf16_mib / 4))
        rows[dtype] = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert rows["bf16"]["cache_frac"] == pytest.approx(0.25)
    for dtype, row in rows.items():  # the same MiB for every dtype
        assert row["expert_cache_mib"] == pytest.approx(rows["bf16"]["expert_cache_mib"], rel=0.05), dtype
    for dtype in ("fp8", "int4"):  # more of the experts: bf16's 25% times the ratio of their bytes
        ratio = bf16_mib / experts_mib(str(tiny_model), dtype)
        assert ratio > 2.5 if dtype == "int4" else ratio > 1.9
        assert rows[dtype]["cache_frac"] == pytest.approx(0.25 * ratio)


def test_cache_mib_and_cache_frac_exclude_each_other(tiny_model):
    with pytest.raises(SystemExit):
        main(["--model", str(tiny_model), "--cache-mib", "4", "--cache-frac", "0.5", "--no-service"])


def test_lm_head_dtype_is_timed_and_reported(tiny_model, capsys):
    _run(tiny_model, "--lm-head-dtype", "fp8", "--attention-dtype", "fp8")
    row = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (row["lm_head_dtype"], row["attention_dtype"]) == ("fp8", "fp8") and row["tok_s"] > 0
