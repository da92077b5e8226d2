"""Qwen3-VL's vision tokens and a ChatML template that renders an image part as Qwen's chat
templates do (``<|vision_start|><|image_pad|><|vision_end|>``, where the part stands), for the models
that moebus makes (``init-model --arch qwen3_vl_moe``) and its tests. The processor then expands each
``<|image_pad|>`` to the image's token count (broker/qwen3vl_requests.py, common/qwen3vl_positions.py)."""
from __future__ import annotations

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
QWEN3VL_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def vision_tokenizer(vocab_size: int, seed: int = 0):
    """The tiny BPE tokenizer (common/tiny_tokenizer.py) with the four vision tokens added after
    its trained vocabulary."""
    from moebus.common.tiny_tokenizer import train_tokenizer

    tokenizer = train_tokenizer(vocab_size, seed=seed)
    tokenizer.add_special_tokens(VISION_TOKENS)
    return tokenizer
