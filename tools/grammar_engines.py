"""Which grammar engine computes token masks faster: llguidance or xgrammar (docs/performance.md).

Mask computation time per decode step for a nested JSON schema at batch 8, against a byte-level BPE
tokenizer of ~100k tokens (trained here on the Python standard library's sources: no model files
are fetched). Each step computes the 8 masks, samples one allowed token per sequence from random
scores and advances the matcher, as the broker would. xgrammar needs torch (it is a test extra, not a
serve dependency): run with it on the path, e.g. ``pip install --target /tmp/xgr --no-deps xgrammar
apache-tvm-ffi`` and ``PYTHONPATH=/tmp/xgr python tools/grammar_engines.py``."""
from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {
            "street": {"type": "string", "maxLength": 32}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "geo": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"]}},
            "required": ["street", "zip", "geo"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4},
        "friends": {"type": "array", "maxItems": 3, "items": {"$ref": "#/$defs/friend"}},
    },
    "required": ["name", "age", "role", "address", "tags", "friends"],
    "$defs": {"friend": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                           "since": {"type": "integer", "minimum": 1990, "maximum": 2030}},
                         "required": ["name", "since"]}},
}


def train(vocab_size: int, cache: str | None = None) -> Tokenizer:
    if cache and Path(cache).is_file():
        return Tokenizer.from_file(cache)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((f.read_text(errors="replace") for f in files), trainer)
    if cache:
        tokenizer.save(cache)
    return tokenizer


def run_llguidance(tokenizer: Tokenizer, batch: int, steps: int, seed: int, rounds: int,
                   parallel: bool = True) -> tuple[float, list[list[float]]]:
    import llguidance
    import llguidance.numpy as llnp

    started = time.perf_counter()
    lltok = llguidance.LLTokenizer(tokenizer.to_str(), eos_token=0)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    template = llguidance.LLMatcher(lltok, grammar, log_level=0)  # compiled once, copied per sequence (as the broker)
    setup_s = time.perf_counter() - started
    bitmask = llnp.allocate_token_bitmask(batch, lltok.vocab_size)
    executor = llguidance.LLExecutor() if parallel else None
    rng = np.random.default_rng(seed)
    return setup_s, [_llguidance_round(llnp, lltok, template, executor, bitmask, batch, steps, rng)
                     for _ in range(rounds)]


def _llguidance_round(llnp, lltok, template, executor, bitmask, batch, steps, rng) -> list[float]:
    matchers = [template.deep_copy() for _ in range(batch)]
    times = []
    for _ in range(steps):
        live = [(m, i) for i, m in enumerate(matchers) if not m.is_stopped()]
        if not live:
            break
        t0 = time.perf_counter()
        if executor is not None:  # llguidance's thread pool over the batch
            llnp.fill_next_token_bitmask_par(executor, live, bitmask)
        else:  # one matcher after the other on this thread, as xgrammar's loop below
            for m, i in live:
                llnp.fill_next_token_bitmask(m, bitmask, i)
        times.append(time.perf_counter() - t0)
        for m, i in live:
            m.consume_token(_pick(bitmask[i].view(np.uint32), lltok.vocab_size, rng))
    return times


def run_xgrammar(tokenizer: Tokenizer, batch: int, steps: int, seed: int, rounds: int) -> tuple[float, list[list[float]]]:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    started = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tokenizer.get_vocab_size())
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    setup_s = time.perf_counter() - started
    bitmask = xgr.allocate_token_bitmask(batch, info.vocab_size)
    rng = np.random.default_rng(seed)
    return setup_s, [_xgrammar_round(xgr, compiled, info, bitmask, batch, steps, rng) for _ in range(rounds)]


def _xgrammar_round(xgr, compiled, info, bitmask, batch, steps, rng) -> list[float]:
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    times = []
    for _ in range(steps):
        live = [(m, i) for i, m in enumerate(matchers) if not m.is_terminated()]
        if not live:
            break
        t0 = time.perf_counter()
        for m, i in live:
            m.fill_next_token_bitmask(bitmask, i)
        times.append(time.perf_counter() - t0)
        for m, i in live:
            m.accept_token(_pick(bitmask[i].numpy().view(np.uint32), info.vocab_size, rng))
    return times


def _pick(words: np.ndarray, vocab: int, rng) -> int:
    allowed = np.nonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab])[0]
    return int(rng.choice(allowed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=4, help="generations of the batch (the first is cold)")
    parser.add_argument("--engines", default="llguidance,llguidance-seq,xgrammar")
    parser.add_argument("--tokenizer-cache", default=None, help="keep the trained tokenizer here")
    args = parser.parse_args()
    t0 = time.perf_counter()
    tokenizer = train(args.vocab, args.tokenizer_cache)
    print(f"tokenizer: {tokenizer.get_vocab_size()} tokens (trained in {time.perf_counter() - t0:.0f} s)")
    for engine in args.engines.split(","):
        run = {"llguidance": run_llguidance, "xgrammar": run_xgrammar,
               "llguidance-seq": lambda *a: run_llguidance(*a, parallel=False)}[engine]
        setup_s, rounds = run(tokenizer, args.batch, args.steps, 0, args.rounds)
        print(f"{engine}: tokenizer + schema compile {setup_s * 1e3:.0f} ms")
        for name, times in (("cold (first generation)", rounds[0]), ("warm (later generations)", sum(rounds[1:], []))):
            ms = np.array(times) * 1e3
            print(f"  {name}: batch {args.batch} masks per step over {len(ms)} steps: mean {ms.mean():.3f} ms, "
                  f"median {np.median(ms):.3f} ms, p90 {np.percentile(ms, 90):.3f} ms, max {ms.max():.3f} ms")


if __name__ == "__main__":
    main()
