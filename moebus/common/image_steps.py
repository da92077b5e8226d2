"""How many tokens one step of an image prompt may take (MOEBUS_IMAGE_STEP_TOKENS, default 2048; 0:
the ``max_step_tokens`` setting, as for any prompt). An image prompt's steps run eagerly (a step holding image
embeddings is never captured), and on the H200 a long step's host launches cost about as much as its
arithmetic at 512 tokens (48 x 32 a3b: 512 tokens 111.8 ms, 2048 tokens 162.8 ms): a 1024 px Qwen3-VL
image (~1,040 tokens) read in one step instead of three pays those launches once. The broker's scheduler
lets an image prompt's step grow to this many tokens; the GPU worker, while the vision worker's VRAM
reserve holds and MOEBUS_RESERVE_SCRATCH=beside, keeps such a step's scratch beside the expert cache
where the device has room (else the step borrows from the cache, the prompt-path loan)."""
from __future__ import annotations

import os

IMAGE_STEP_TOKENS = int(os.environ.get("MOEBUS_IMAGE_STEP_TOKENS", "2048") or 0)


def image_step_tokens(max_step_tokens: int) -> int:
    """The tokens one step of an image prompt may take: never fewer than any prompt's."""
    return max(int(max_step_tokens), IMAGE_STEP_TOKENS)
