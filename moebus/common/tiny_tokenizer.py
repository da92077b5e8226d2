"""A byte-level BPE tokenizer for the models that moebus makes itself, trained with ``tokenizers``
on a small corpus generated from a fixed word list (same seed, same tokenizer)."""
from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
IMAGE_TOKEN = "<image>"  # the placeholder of vision models (LlavaProcessor's default), added after training
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') %}{{- '<image>' }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORDS = """the a an and or but if then when while of to in on at by for with from as is are was were be
been being have has had do does did will would can could should may might must not no yes this that
these those it its he she they we you i me him her them us my your our their what which who whom whose
where why how all any both each few more most other some such only own same so than too very just
model expert token layer cache memory device server request stream reply message worker broker image
vision router weight slot segment reserve shrink grow host copy kernel batch decode prefill sample
prompt answer question time fast slow small large first last next new old good great high low long
short early late young important public bad able run runs ran make makes made take takes took see
sees saw come comes came think thinks know knows get gets give gives find finds tell tells ask asks
work works seem seems feel feels try tries leave leaves call calls keep keeps let lets begin begins
show shows hear hears play plays move moves live lives believe hold holds bring brings happen write
writes provide sit stand lose pay meet include continue set learn change lead understand watch follow
stop create speak read allow add spend grow open walk win offer remember love consider appear buy wait
serve die send expect build stay fall cut reach kill remain suggest raise pass sell require report
decide pull one two three four five six seven eight nine ten hundred thousand day week year world
life hand part child eye woman man place case point group number night water room mother area money
story fact month lot right study book job word business issue side kind head house service friend
father power hour game line end member law car city community name president team minute idea body
information back parent face others level office door health person art war history party result
morning reason research girl guy moment air teacher force education""".split()


def corpus(num_sentences: int = 4000, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    zipf = 1.0 / np.arange(1, len(_WORDS) + 1)
    zipf /= zipf.sum()
    lines = []
    for _ in range(num_sentences):
        words = list(rng.choice(_WORDS, size=int(rng.integers(4, 16)), p=zipf))
        if rng.random() < 0.2:
            words.insert(int(rng.integers(len(words))), str(int(rng.integers(0, 2000))))
        text = " ".join(words)
        lines.append(text[0].upper() + text[1:] + rng.choice([".", ".", ".", "?", "!", ","]))
    return lines


def train_tokenizer(vocab_size: int, seed: int = 0, image_token: bool = False) -> Tokenizer:
    """``image_token``: add IMAGE_TOKEN as a special token after the trained vocabulary (so every
    other id stays what it is without it)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(seed=seed), trainer)
    if image_token:
        tokenizer.add_special_tokens([IMAGE_TOKEN])
    return tokenizer
