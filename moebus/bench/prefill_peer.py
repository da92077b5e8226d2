"""The prefill peer: HF transformers' forward over a moebus checkpoint directory (bf16, on the
GPU), one JSON line per length. Run by ``moebus bench prefill --peer hf`` as a separate process
(torch is not a dependency of moebus). Usage: python -m moebus.bench.prefill_peer DIR 512,2048 REPEATS"""
from __future__ import annotations

import json
import statistics
import sys
import time


def main(model_dir: str, lengths: str, repeats: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda").eval()
    vocab = model.config.vocab_size
    for num_tokens in (int(n) for n in lengths.split(",")):
        ids = torch.tensor([[(7 * i + 3) % (vocab - 10) + 10 for i in range(num_tokens)]], device="cuda")
        times = []
        with torch.no_grad():
            for _ in range(int(repeats) + 1):
                torch.cuda.synchronize()
                start = time.perf_counter()
                model(ids, logits_to_keep=1, use_cache=False)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
        print(json.dumps({"tokens": num_tokens, "seconds": statistics.median(times[1:])}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
