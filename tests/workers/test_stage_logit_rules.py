"""The last stage applies a step's logit rules before sampling and still reports raw logprobs."""
import numpy as np

from moebus.cuda.kernels.penalties import LogitRules, token_logprobs_ref
from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel


def test_rules_steer_the_sampled_token_and_logprobs_stay_raw(tiny_model):
    model = LocalModel(tiny_model, parts=2, max_context=64)
    prompts = [[5, 9, 13], [7, 7, 7, 8]]
    batch = dict(slots=[0, 1], starts=[0, 0], lengths=[3, 4], tokens=np.concatenate(prompts),
                 temperature=[0.0, 0.0])
    plain = model.step(StepBatch(**batch), want_logits=True)
    forced = 60 if plain.tokens[0] != 60 else 61
    # row 0: a bias forces a token; row 1: a repetition penalty over its prompt only
    rules = LogitRules.from_lengths([[0, 0, 1, 0], [0, 0, 2.0, 0]], [1, 2], [forced, 7, 8], [-1, 0, 0],
                                    [100.0, 0.0, 0.0])
    out = model.step(StepBatch(**batch, logit_rules=rules), want_logits=True)
    assert out.tokens[0] == forced
    np.testing.assert_allclose(out.logprobs, token_logprobs_ref(plain.logits, out.tokens), atol=1e-5)
    row = plain.logits[1].copy()
    row[[7, 8]] = np.where(row[[7, 8]] > 0, row[[7, 8]] / 2.0, row[[7, 8]] * 2.0)
    assert out.tokens[1] == int(np.argmax(row))
