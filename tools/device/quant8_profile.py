"""GPU time by kernel of replayed decode steps (decode_profile.py) with the experts and the attention
projections in the given dtypes: where a quantized step's time goes, beside its wall time. The
eighth session's 24-layer figures left ~70 us a layer that fewer bytes did not shorten.

    quant8_profile.py MODEL EXPERTS ATTENTION [BATCH...]     (e.g. /tmp/a3b-24x32 fp8 fp8 1 8)"""
import sys

import decode_profile

from moebus.workers.local import LocalModel


def main() -> None:
    model_dir, experts, attention = sys.argv[1:4]
    batches = [int(b) for b in sys.argv[4:]] or [1, 8]
    model = LocalModel(model_dir, device="cuda", num_slots=max(batches), max_context=256, experts_dtype=experts,
                       attention_dtype=attention)
    print(f"== experts {experts}, attention {attention}")
    for batch in batches:
        decode_profile.profile_batch(model, batch, model.ckpt.config.num_layers)


if __name__ == "__main__":
    main()
