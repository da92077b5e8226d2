"""``moebus bench quality``: quantized experts against the bf16 model. Both models decode the same
held-out prompts in lock step, teacher-forced on the bf16 model's greedy tokens (or, ``--follow-text``,
on the prompt text's own next tokens); at every decode
step the bench compares the two next-token distributions: top-1 agreement (same argmax) and
KL(p_bf16 || p_quantized). An FP8 checkpoint's reference is its experts dequantized to bf16.
How hard the test is shows in two more figures of the bf16 model: the mean entropy of its next-token
distributions (a sure model agrees with a perturbed copy of itself more easily) and the fraction of
distinct tokens in its greedy continuations (a model stuck in a loop repeats itself)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

# Held out: no test or bench tunes anything on these texts.
HELD_OUT = (
    "The lighthouse keeper wrote in his log that the storm had passed before dawn, and that",
    "To make bread without a scale, start with three cups of flour and",
    "In 1854 the physician John Snow mapped the cholera cases around Broad Street and found",
    "A binary search tree keeps its keys in order, so finding the smallest key means",
    "Der Zug nach Hamburg hatte zwanzig Minuten Verspätung, weil",
    "Photosynthesis turns light, water and carbon dioxide into sugar; the oxygen we breathe",
    "Once upon a time, in a village at the edge of a forest, there lived a clockmaker who",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
)


FOLLOW_PROMPT = 32  # --follow-text: the prompt's tokens; the text's next ones are fed step by step


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def compare_step(ref_logits: np.ndarray, test_logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: (same argmax, KL(p_ref || p_test) in nats)."""
    ref, test = _log_softmax(ref_logits), _log_softmax(test_logits)
    agree = ref.argmax(axis=-1) == test.argmax(axis=-1)
    return agree, np.sum(np.exp(ref) * (ref - test), axis=-1)


def _entropy(logits: np.ndarray) -> np.ndarray:
    """Per row: the entropy (nats) of the softmax: log(vocab) for uniform logits, 0 where a model is
    sure of the next token."""
    lp = _log_softmax(logits)
    return -np.sum(np.exp(lp) * lp, axis=-1)


def held_out_prompts(model_dir: str, num_prompts: int, vocab_size: int, texts=HELD_OUT) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    prompts = [[t % vocab_size for t in tokenizer.encode(text).ids] or [1] for text in texts]
    return (prompts * (-(-num_prompts // len(prompts))))[:num_prompts]


def measure(model_dir: str, experts_dtype: str, steps: int, num_prompts: int = 8, device: str = "cpu",
            attention_dtype: str = "bf16", texts=HELD_OUT, follow_text: bool = False,
            lm_head_dtype: str = "bf16", kv_dtype: str = "fp32") -> dict:
    """Top-1 agreement and mean KL over ``steps`` decode steps of each of ``num_prompts`` prompts (cut
    from ``texts``), the bf16 model against experts in ``experts_dtype``, attention projections in
    ``attention_dtype`` and the lm_head in ``lm_head_dtype``. ``follow_text``: each prompt is a text's
    first FOLLOW_PROMPT tokens and the steps feed the text's own next tokens instead of the bf16
    model's greedy ones (a weak model's greedy continuation soon loops; the text does not). ``kv_dtype``: both
    models' KV caches (fp32: the quantization's effect alone; bf16: the service's default on cuda)."""
    from moebus.workers.batch import StepBatch
    from moebus.workers.local import LocalModel

    def load(dtype, attention="bf16", lm_head="bf16"):
        return LocalModel(model_dir, device=device, num_slots=num_prompts, max_context=context, experts_dtype=dtype,
                          attention_dtype=attention, lm_head_dtype=lm_head, kv_dtype=kv_dtype)

    from moebus.common.model_config import load_config

    prompts = held_out_prompts(model_dir, num_prompts, load_config(model_dir).vocab_size, texts)
    if follow_text:
        short = [len(p) for p in prompts if len(p) < FOLLOW_PROMPT + steps - 1]
        if short:
            raise ValueError(f"--follow-text needs texts of {FOLLOW_PROMPT + steps - 1} tokens; one has {min(short)}")
        forced = np.array([p[FOLLOW_PROMPT:FOLLOW_PROMPT + steps - 1] for p in prompts], np.int32)
        prompts = [p[:FOLLOW_PROMPT] for p in prompts]
    context = max(len(p) for p in prompts) + steps + 1
    ref, test = load("bf16"), load(experts_dtype, attention_dtype, lm_head_dtype)
    slots = np.arange(len(prompts))
    batch = StepBatch(slots=slots, starts=np.zeros(len(prompts)), lengths=[len(p) for p in prompts],
                      tokens=np.concatenate(prompts))
    agree, kl, entropy, greedy = [], [], [], []
    ref_logits, test_logits = ref.step(batch, want_logits=True).logits, test.step(batch, want_logits=True).logits
    positions = np.array([len(p) for p in prompts])
    for i in range(steps):  # the first comparison is the prefill's last position
        a, k = compare_step(ref_logits, test_logits)
        agree.append(a)
        kl.append(k)
        entropy.append(_entropy(ref_logits))
        greedy.append(ref_logits.argmax(axis=-1))
        if i == steps - 1:
            break
        step = StepBatch(slots=slots, starts=positions + i, lengths=np.ones(len(prompts)),
                         tokens=forced[:, i] if follow_text else ref_logits.argmax(axis=-1).astype(np.int32))
        ref_logits, test_logits = ref.step(step, want_logits=True).logits, test.step(step, want_logits=True).logits
    agree, kl = np.concatenate(agree), np.concatenate(kl)
    return {"model": Path(model_dir).name, "experts_dtype": experts_dtype, "attention_dtype": attention_dtype,
            "lm_head_dtype": lm_head_dtype, "follow": "text" if follow_text else "greedy", "steps": steps,
            "prompts": len(prompts),
            "comparisons": int(agree.size), "top1_agreement": float(agree.mean()), "mean_kl": float(kl.mean()),
            "p99_kl": float(np.quantile(kl, 0.99)), "max_kl": float(kl.max()),
            "ref_entropy": float(np.mean(entropy)),
            "ref_distinct_tokens": float(np.mean([len(set(col)) for col in np.stack(greedy, axis=1)]) / len(greedy)),
            "expert_bytes_ratio": ref.stages[0].experts.store.blob_bytes / test.stages[0].experts.store.blob_bytes}



def _prompt_texts(path: str) -> list[str]:
    """--prompt-file's texts: a non-empty JSON list of strings, else a clear exit naming the file."""
    try:
        texts = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise SystemExit(f"{path}: cannot read a JSON list of prompt texts ({type(e).__name__}: {e})")
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise SystemExit(f"{path}: expected a non-empty JSON list of strings")
    return texts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moebus bench quality")
    p.add_argument("--model", help="model directory (default: the embedded demo model)")
    p.add_argument("--experts-dtype", default="fp8,int4", help="fp8, int4 or both, comma separated")
    p.add_argument("--attention-dtype", default="bf16", choices=["bf16", "fp8"],
                   help="the quantized model's q/k/v/o projections (settings attention.dtype)")
    p.add_argument("--lm-head-dtype", default="bf16", choices=["bf16", "fp8"],
                   help="the quantized model's lm_head (settings lm_head.dtype)")
    p.add_argument("--steps", type=int, default=256, help="decode steps per prompt")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts decoded side by side")
    p.add_argument("--prompt-file", help="a JSON list of prompt texts (default: the bench's own HELD_OUT)")
    p.add_argument("--follow-text", action="store_true",
                   help="feed each prompt text's own tokens after its first 32 instead of the bf16 model's greedy ones")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    texts = _prompt_texts(args.prompt_file) if args.prompt_file else HELD_OUT
    from moebus.common.demo_model import demo_model_dir

    model_dir = args.model or str(demo_model_dir())
    for dtype in args.experts_dtype.split(","):
        r = measure(model_dir, dtype, args.steps, args.prompts, args.device, args.attention_dtype, texts,
                    args.follow_text, args.lm_head_dtype)
        print(json.dumps(r) if args.json else "  ".join(f"{k}={_fmt(v)}" for k, v in r.items()))
    return 0


def _fmt(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
