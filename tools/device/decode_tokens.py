"""The greedy decode loop the device checks share: one prompt step for ``batch`` sequences, then
``steps`` decode steps, each sequence fed its own last token."""
import time

import numpy as np

from moebus.workers.batch import StepBatch


def decode_tokens(model, prompt: list[int], batch: int, steps: int, first_offset: int = 1):
    """(tokens [steps, batch], logprobs [steps, batch], seconds of the decode steps). Sequence s starts
    its decode from ``prompt[-1] + s * first_offset``, so batch rows differ when the offset is 1."""
    model.step(StepBatch(slots=range(batch), starts=[0] * batch, lengths=[len(prompt)] * batch, tokens=prompt * batch))
    last = [prompt[-1] + s * first_offset for s in range(batch)]
    out_tokens, out_lp = [], []
    t = time.perf_counter()
    for i in range(steps):
        out = model.step(StepBatch(slots=range(batch), starts=[len(prompt) + i] * batch, lengths=[1] * batch,
                                   tokens=last))
        last = [int(x) for x in out.tokens]
        out_tokens.append(last)
        out_lp.append(out.logprobs.copy())
    return np.array(out_tokens), np.array(out_lp), time.perf_counter() - t


def decode_tokens_ahead(model, prompt: list[int], batch: int, steps: int, first_offset: int = 1):
    """decode_tokens through LocalModel.decode: each step launched before the one before is read."""
    model.step(StepBatch(slots=range(batch), starts=[0] * batch, lengths=[len(prompt)] * batch, tokens=prompt * batch))
    first = [prompt[-1] + s * first_offset for s in range(batch)]
    batches = (StepBatch(slots=range(batch), starts=[len(prompt) + i] * batch, lengths=[1] * batch, tokens=first)
               for i in range(steps))
    out_tokens, out_lp = [], []
    t = time.perf_counter()
    for out in model.decode(batches):
        out_tokens.append([int(x) for x in out.tokens])
        out_lp.append(out.logprobs.copy())
    return np.array(out_tokens), np.array(out_lp), time.perf_counter() - t
