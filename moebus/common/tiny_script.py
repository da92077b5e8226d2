"""A scripted tiny model: weights constructed so that greedy decoding writes one given text after any
prompt, then the end-of-sequence token. The api's tests need a real served model that writes
``<tool_call>`` blocks, ``<think>`` blocks and the like, which random weights never do by themselves.

How: the text is cut into pieces that become tokens of their own (added tokens, each a new id, no
two alike), so the text is a chain of distinct tokens and the next one is a function of the current
one alone. Each chain token's embedding gets a large component on a dimension of its own, every
other token's on one shared "start" dimension; the unembedding row of a token reads the dimension
of the token before it in the chain (the start dimension for the first, the last piece's for the
end of sequence) and nothing else. The layers keep their random weights and run as ever: their
outputs are small next to that component, so the argmax is the chain's next token with a wide
margin, in moebus and in transformers alike."""
from __future__ import annotations

import numpy as np
from tokenizers import AddedToken, Tokenizer

EMBED_SCALE = 8.0  # times sqrt(hidden): the chain component, next to the layers' O(1) outputs
LOGIT_GAIN = 2.0  # the successor's logit is about LOGIT_GAIN * sqrt(hidden); others stay near 0


def script_pieces(text: str, taken: set[str], piece_chars: int) -> list[str]:
    """``text`` cut into pieces of about ``piece_chars`` characters, no two alike and none a token
    the tokenizer has already (a piece that repeats an earlier one grows until it does not)."""
    pieces: list[str] = []
    i = 0
    while i < len(text):
        k = piece_chars
        while i + k < len(text) and (text[i:i + k] in pieces or text[i:i + k] in taken):
            k += 1
        piece = text[i:i + k]
        if (piece in pieces or piece in taken) and pieces:  # the short end repeats: join it to the last piece
            piece = pieces.pop() + piece
        if piece in pieces or piece in taken:
            raise ValueError(f"the script cannot be cut into distinct new tokens (at {piece!r})")
        pieces.append(piece)
        i += k
    return pieces


def add_script_tokens(tokenizer: Tokenizer, text: str, vocab_size: int, hidden_size: int,
                      piece_chars: int = 6) -> list[int]:
    """Adds the script's pieces to ``tokenizer`` as tokens; returns their ids in order."""
    base = tokenizer.get_vocab_size(with_added_tokens=True)
    pieces = script_pieces(text, set(tokenizer.get_vocab(with_added_tokens=True)), piece_chars)
    if len(pieces) + 1 > hidden_size or base + len(pieces) > vocab_size:
        raise ValueError(f"a script of {len(pieces)} pieces does not fit {hidden_size} dimensions and "
                         f"{vocab_size - base} free token ids: make it shorter or its pieces longer")
    tokenizer.add_tokens([AddedToken(p, special=False, normalized=False) for p in pieces])
    ids = [tokenizer.token_to_id(p) for p in pieces]
    assert ids == list(range(base, base + len(pieces))), "each piece is a new token"
    return ids


def scripted_tensors(tensors: dict[str, np.ndarray], chain: list[int], eos: int) -> dict[str, np.ndarray]:
    """``tensors`` (float32) with the embedding and unembedding that make greedy decoding follow
    ``chain`` from any prompt and end with ``eos``."""
    embed = tensors["model.embed_tokens.weight"].copy()
    vocab, hidden = embed.shape
    start_dim = hidden - 1
    scale = np.float32(EMBED_SCALE * np.sqrt(hidden))
    others = np.setdiff1d(np.arange(vocab), chain)
    embed[others, start_dim] += scale
    embed[chain, np.arange(len(chain))] += scale
    head = np.zeros((vocab, hidden), np.float32)
    gain = np.float32(LOGIT_GAIN)
    head[chain[0], start_dim] = gain
    head[chain[1:], np.arange(len(chain) - 1)] = gain
    head[eos, len(chain) - 1] = gain
    return {**tensors, "model.embed_tokens.weight": embed, "lm_head.weight": head}
