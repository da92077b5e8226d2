"""Train a small Qwen3-MoE on real text on the CPU, so that ``moebus bench quality`` measures
quantization on a TRAINED model (a random-weight model's argmax flips under any small perturbation).

Corpus: Python's own standard library sources (code, docstrings, comments; found through
``sysconfig``), or any files given with ``--corpus``. Files are split by name (every
``--held-out-every``-th file sorted by path is held out); the tokenizer (byte-level BPE) is trained
on the training split only. The model is trained in float32 with the router's load-balancing loss
and saved by transformers' ``save_pretrained`` in bf16 (safetensors, config, tokenizer), beside
``train_log.json`` (the loss curve, held-out loss before and after), ``held_out_prompts.json``
(prompts cut from held-out files, for ``moebus bench quality --prompt-file``) and
``held_out_texts.json`` (longer pieces, for ``--prompt-file … --follow-text``). ``--fp8 DIR`` also
writes the trained model as an FP8 checkpoint in Qwen's format (common/fp8_convert.fp8_copy);
``--check`` compares moebus with transformers on what was written.

Needs torch and transformers (the ``test`` extra), not part of ``make serve``:

    python tools/train_tiny_moe.py --out /tmp/trained --minutes 12 --threads 2 --fp8 /tmp/trained-fp8
"""
from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path

import numpy as np

SHAPES = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
              num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, intermediate_size=512)


def corpus_files(paths: list[str] | None, max_bytes: int) -> list[Path]:
    """The corpus' files, sorted by path, up to ``max_bytes`` in all. Default: the stdlib's own
    top-level modules (no tests, no site-packages)."""
    if paths:
        files = sorted(f for p in paths for f in (Path(p).rglob("*") if Path(p).is_dir() else [Path(p)]) if f.is_file())
    else:
        files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    kept, total = [], 0
    for f in files:
        size = f.stat().st_size
        if 0 < size <= 400_000 and total + size <= max_bytes:
            kept.append(f)
            total += size
    return kept


def split_files(files: list[Path], held_out_every: int) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts): every ``held_out_every``-th file held out, and the last one where
    fewer files than that are given (a corpus of 9 files held none out: docs/ once performance.md passed the
    size limit), so that there is always a held-out loss to measure."""
    texts = [f.read_text(errors="replace") for f in files]
    held_at = {i for i in range(len(texts)) if i % held_out_every == held_out_every - 1}
    if not held_at and len(texts) > 1:
        held_at = {len(texts) - 1}
    held = [t for i, t in enumerate(texts) if i in held_at]
    train = [t for i, t in enumerate(texts) if i not in held_at]
    return train, held


def train_bpe(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from moebus.common.tiny_tokenizer import SPECIAL_TOKENS

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def encode(tokenizer, texts: list[str]) -> np.ndarray:
    """All texts as one stream of ids, each file ended by <|endoftext|>."""
    eot = tokenizer.token_to_id("<|endoftext|>")
    return np.concatenate([np.array(e.ids + [eot], np.int64) for e in tokenizer.encode_batch(texts)])


def make_model(vocab_size: int, shapes: dict, eos: int, seed: int):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=vocab_size, max_position_embeddings=2048, rope_theta=10000.0, norm_topk_prob=True,
                         tie_word_embeddings=False, router_aux_loss_coef=0.01, eos_token_id=eos, bos_token_id=None,
                         **shapes)
    return Qwen3MoeForCausalLM(cfg)


def held_out_loss(model, ids: np.ndarray, seq_len: int, max_windows: int = 32) -> float:
    """Mean next-token cross entropy (nats) over up to ``max_windows`` evenly spaced windows."""
    import torch

    starts = np.linspace(0, len(ids) - seq_len - 1, num=min(max_windows, (len(ids) - 1) // seq_len)).astype(int)
    batch = torch.from_numpy(np.stack([ids[s:s + seq_len] for s in starts]))
    model.eval()
    with torch.no_grad():
        loss = model(batch, labels=batch).loss.item()
    model.train()
    return loss


def train(model, train_ids: np.ndarray, held_ids: np.ndarray, seconds: float, seq_len: int, batch_size: int,
          lr: float, seed: int, max_steps: int | None = None, log_every: int = 25) -> dict:
    """AdamW with a short warm-up and a cosine decay over the wall-clock budget (or ``max_steps``,
    whichever ends first); returns the log."""
    import torch

    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    log = {"held_out_loss_initial": held_out_loss(model, held_ids, seq_len), "curve": []}
    print(f"step 0  held-out loss {log['held_out_loss_initial']:.3f} (random weights)", flush=True)
    begin, step, recent = time.monotonic(), 0, []
    while (elapsed := time.monotonic() - begin) < seconds and step < (max_steps or math.inf):
        frac = max(elapsed / seconds, step / (max_steps or math.inf))
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        starts = rng.integers(0, len(train_ids) - seq_len - 1, size=batch_size)
        batch = torch.from_numpy(np.stack([train_ids[s:s + seq_len] for s in starts]))
        out = model(batch, labels=batch, output_router_logits=True)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        recent.append(out.loss.item() - model.config.router_aux_loss_coef * out.aux_loss.item())
        if step % log_every == 0:
            row = {"step": step, "seconds": round(time.monotonic() - begin, 1), "train_loss": float(np.mean(recent))}
            if step % (4 * log_every) == 0:
                row["held_out_loss"] = held_out_loss(model, held_ids, seq_len)
            log["curve"].append(row)
            recent = []
            print("  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    log.update(steps=step, seconds=round(time.monotonic() - begin, 1), tokens=step * batch_size * seq_len,
               held_out_loss_final=held_out_loss(model, held_ids, seq_len))
    print(f"step {step}  held-out loss {log['held_out_loss_final']:.3f} (trained; random: "
          f"{log['held_out_loss_initial']:.3f}, uniform: {math.log(model.config.vocab_size):.3f})", flush=True)
    return log


def prompts_from(texts: list[str], count: int, chars: int, seed: int, lines_each: int = 10) -> list[str]:
    """``count`` prompts of at most ``chars`` characters: ``lines_each`` lines from a random line
    start of a random held-out text."""
    rng = np.random.default_rng(seed)
    texts = [t.splitlines(keepends=True) for t in texts if t.strip()]
    texts = [lines for lines in texts if len(lines) >= 2 * lines_each] or texts  # long files where there are
    if not texts:
        raise ValueError("no held-out text to cut prompts from")
    out = []
    while len(out) < count:
        lines = texts[int(rng.integers(len(texts)))]
        first = int(rng.integers(max(1, len(lines) - lines_each)))
        piece = "".join(lines[first:first + lines_each])[:chars]
        if piece.strip():
            out.append(piece)
    return out


def held_out_texts(texts: list[str], seed: int) -> list[str]:
    """Eight pieces of ~80 lines for ``bench quality --follow-text`` (32 prompt tokens + 255 fed)."""
    return prompts_from(texts, 8, 3000, seed + 1, lines_each=80)


def save(model, tokenizer, out: Path, log: dict, prompts: list[str], texts: list[str]) -> None:
    import torch

    from moebus.common.tiny_tokenizer import SPECIAL_TOKENS

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "additional_special_tokens": SPECIAL_TOKENS[1:]}, indent=2))
    (out / "train_log.json").write_text(json.dumps(log, indent=1))
    (out / "held_out_prompts.json").write_text(json.dumps(prompts, indent=1))
    (out / "held_out_texts.json").write_text(json.dumps(texts, indent=1))


def check_against_transformers(model_dir: Path, prompts: list[str], num_tokens: int = 32, fp8: bool = False) -> dict:
    """moebus (cpu device) against transformers on the same weights, on ``prompts``: the largest
    difference of a prefill's last-position log-probabilities, and whether ``num_tokens`` greedy
    tokens agree. An FP8 checkpoint (``fp8``: fp8 experts and attention) is compared with
    transformers on its own weights dequantized (fp8_convert.dequantized_copy), in a temp dir."""
    import tempfile

    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from moebus.bench.quality import _log_softmax
    from moebus.common.fp8_convert import dequantized_copy
    from moebus.workers.local import LocalModel

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = [tokenizer.encode(p).ids[:96] for p in prompts]
    dtype = "fp8" if fp8 else "bf16"
    ours = LocalModel(str(model_dir), device="cpu", num_slots=len(ids), max_context=256, experts_dtype=dtype,
                      attention_dtype=dtype)
    with tempfile.TemporaryDirectory() as tmp:
        ref_dir = dequantized_copy(model_dir, Path(tmp) / "ref", attention_exact=True) if fp8 else model_dir
        hf = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    diff, same = 0.0, True
    for prompt, row in zip(ids, ours.prefill_logits(ids)):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1].numpy()
            greedy = hf.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):]
        diff = max(diff, float(np.abs(_log_softmax(row) - _log_softmax(ref)).max()))
        same = same and ours.generate(prompt, num_tokens).tokens == greedy.tolist()
    return {"max_logprob_diff": diff, "greedy_equal": same}


def run(out: Path, seconds: float, threads: int = 2, shapes: dict | None = None, vocab_size: int = 2048,
        corpus: list[str] | None = None, max_corpus_bytes: int = 6_000_000, held_out_every: int = 10,
        seq_len: int = 128, batch_size: int = 16, lr: float = 3e-3, seed: int = 0, fp8: Path | None = None,
        max_steps: int | None = None) -> dict:
    """Train and save; returns the training log."""
    import torch

    from moebus.common.fp8_convert import fp8_copy

    torch.set_num_threads(threads)
    train_texts, held_texts = split_files(corpus_files(corpus, max_corpus_bytes), held_out_every)
    tokenizer = train_bpe(train_texts, vocab_size)
    train_ids, held_ids = encode(tokenizer, train_texts), encode(tokenizer, held_texts)
    print(f"corpus: {len(train_texts)} training files ({len(train_ids)} tokens), {len(held_texts)} held out "
          f"({len(held_ids)} tokens), vocabulary {tokenizer.get_vocab_size()}", flush=True)
    model = make_model(tokenizer.get_vocab_size(), shapes or SHAPES, tokenizer.token_to_id("<|endoftext|>"), seed)
    log = train(model, train_ids, held_ids, seconds, seq_len, batch_size, lr, seed, max_steps)
    log.update(corpus_train_tokens=int(len(train_ids)), corpus_held_out_tokens=int(len(held_ids)),
               threads=threads, seq_len=seq_len, batch_size=batch_size, lr=lr)
    save(model, tokenizer, out, log, prompts_from(held_texts, 8, 400, seed), held_out_texts(held_texts, seed))
    if fp8:
        fp8_copy(out, fp8)
    return log


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="model directory to write")
    p.add_argument("--minutes", type=float, default=12.0, help="wall-clock training budget")
    p.add_argument("--threads", type=int, default=2, help="torch threads (the machine is shared: 1-2)")
    p.add_argument("--corpus", nargs="*", help="files or directories (default: the stdlib's *.py)")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, help="stop after this many steps if the time is not up first")
    p.add_argument("--fp8", help="also write the trained model as an FP8 checkpoint (Qwen's format) here")
    p.add_argument("--check", action="store_true", help="only compare moebus with transformers on --out (and --fp8)")
    p.add_argument("--head-dim", type=int, default=SHAPES["head_dim"],
                   help="attention heads' width (128: the tensor-core decode attention's, rope_attention.py)")
    args = p.parse_args(argv)
    if args.check:
        for model_dir, fp8 in [(Path(args.out), False)] + ([(Path(args.fp8), True)] if args.fp8 else []):
            prompts = json.loads((model_dir / "held_out_prompts.json").read_text())
            print(model_dir, json.dumps(check_against_transformers(model_dir, prompts, fp8=fp8)), flush=True)
        return 0
    run(Path(args.out), args.minutes * 60, args.threads, vocab_size=args.vocab, corpus=args.corpus,
        seq_len=args.seq_len, batch_size=args.batch, lr=args.lr, seed=args.seed,
        fp8=Path(args.fp8) if args.fp8 else None, max_steps=args.max_steps,
        shapes=dict(SHAPES, head_dim=args.head_dim))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
