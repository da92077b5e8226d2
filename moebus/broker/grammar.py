"""Structured outputs in the broker: llguidance grammars compiled against the model's tokenizer, one
matcher per constrained sequence, and the allowed-token bitmasks of a step.

- ``GrammarEngine``: the tokenizer as llguidance sees it (``tokenizer.json`` through the
  ``tokenizers`` library: every token's bytes, the special tokens, byte fallback), built once when
  the broker starts (``warm_engine``), and a small cache of compiled grammars (the n choices of one
  request, or a client that repeats its schema, compile once and copy the matcher).
- Compiling runs on the tokenizer threads (admission.make_sequence), never on the broker's loop,
  under llguidance's resource limits and a wall-clock deadline: a hostile schema (huge, deep,
  recursive, invalid) is a 400 naming why, and other requests go on meanwhile.
- One sequence's matcher and its next mask: broker/grammar_state.py.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import llguidance
import numpy as np

from moebus.broker.grammar_specs import grammar_text
from moebus.common.errors import RequestError
from moebus.common.protocol import Constraint
from moebus.broker.grammar_state import ACTIVE, OPENING, WAITING, GrammarState
from moebus.common.tokenizer import THINK_CLOSE, THINK_OPEN, TextTokenizer
from moebus.cuda.kernels.sampling import mask_words

log = logging.getLogger("moebus.broker")
COMPILE_DEADLINE_S = 5.0  # a grammar that takes longer is refused (llguidance's limits bound it too)
MAX_CACHED_GRAMMARS = 64
MASK_THREADS = 2
# llguidance's limits, tighter than its defaults where a request could make a compile slow
LIMITS = dict(max_grammar_size=200_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
              max_lexer_states=100_000, verbose_errors=False)


class GrammarEngine:
    def __init__(self, tokenizer: TextTokenizer, vocab_size: int):
        n_vocab = max(vocab_size, tokenizer.tokenizer.get_vocab_size(with_added_tokens=True))
        eos = sorted(tokenizer.stop_ids) or None
        self.lltok = llguidance.LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=n_vocab, eos_token=eos)
        self.vocab_size = vocab_size  # the model's: the sampler's rows, and the masks' width
        self.words = mask_words(vocab_size)
        self.engine_words = mask_words(n_vocab)
        # the tokens that open a reasoning block (Qwen3: one, <think>); none for a model without blocks
        vocab = tokenizer.tokenizer.get_vocab(with_added_tokens=True) if tokenizer.emits_reasoning else {}
        self.think_open_ids = np.array(sorted(i for t, i in vocab.items() if t.startswith(THINK_OPEN) and i < vocab_size),
                                       np.int64)
        self.think_close = tokenizer.tokenizer.token_to_id(THINK_CLOSE) if tokenizer.emits_reasoning else None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        # next-token masks, computed as soon as a token is accepted (llguidance releases the GIL)
        self.masks = ThreadPoolExecutor(MASK_THREADS, thread_name_prefix="grammar-masks")

    def start(self, constraint: Constraint, reasoning_open: bool | None) -> "GrammarState":
        """A new sequence's grammar state; RequestError (400) when the constraint cannot compile.
        ``reasoning_open``: admission's (None: no reasoning split, e.g. a completion)."""
        if reasoning_open:
            mode = WAITING
        elif reasoning_open is False and len(self.think_open_ids):
            mode = OPENING
        else:
            mode = ACTIVE
        return GrammarState(self, self._matcher(constraint), mode)

    def _matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        grammar = grammar_text(constraint)
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled.deep_copy()
        started = time.monotonic()
        matcher = llguidance.LLMatcher(self.lltok, grammar, log_level=0,
                                       limits=llguidance.LLParserLimits(**LIMITS))  # drops the GIL
        elapsed_s = time.monotonic() - started
        if matcher.is_error():
            raise RequestError(f"{constraint.param}: cannot be compiled: {matcher.get_error()[:300]}",
                               param=constraint.param, code="invalid_grammar")
        if elapsed_s > COMPILE_DEADLINE_S:
            raise RequestError(f"{constraint.param}: took {elapsed_s:.1f} s to compile (the limit is "
                               f"{COMPILE_DEADLINE_S:g} s); simplify it", param=constraint.param, code="invalid_grammar")
        with self._lock:
            self._compiled[grammar] = matcher.deep_copy()
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return matcher


_engine_lock = threading.Lock()


@functools.lru_cache(maxsize=4)
def _build(tokenizer: TextTokenizer, vocab_size: int) -> GrammarEngine:
    return GrammarEngine(tokenizer, vocab_size)


def engine_for(tokenizer: TextTokenizer, vocab_size: int) -> GrammarEngine:
    """The engine of a tokenizer, built on first use (the broker builds it at start-up)."""
    with _engine_lock:  # one build, even when the start-up thread and a request race for it
        return _build(tokenizer, vocab_size)


def warm_engine(tokenizer: TextTokenizer, vocab_size: int) -> threading.Thread:
    """Build the engine on a thread at start-up (~1 s for a 150k vocabulary), off the broker's loop."""
    thread = threading.Thread(target=engine_for, args=(tokenizer, vocab_size), name="grammar-engine", daemon=True)
    thread.start()
    return thread
