"""A tiny model directory (moebus init-model) whose chat template has the structure of Qwen3's: tools
listed as JSON in the system turn, earlier reasoning dropped before the last user query, assistant
reasoning rebuilt from ``reasoning_content`` or split from ``<think>`` blocks, tool calls and tool
responses wrapped in tags, and ``enable_thinking`` deciding the generation prompt. ``opens_thinking``
makes a template whose generation prompt opens the block itself (as Qwen3's thinking-only models
and DeepSeek-R1 do), so that an answer starts as reasoning. The tags are added tokens, as in Qwen3."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from moebus.common.tiny_model import init_model

TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

QWEN3_LIKE_TEMPLATE = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call functions. Their signatures, inside <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nTo call one, answer a JSON object with its name and arguments' }}
{{- ' inside <tool_call></tool_call>:\\n' }}
{{- '<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
{%- set index = (messages|length - 1) - loop.index0 %}
{%- if ns.multi_step_tool and message.role == 'user' and message.content is string
      and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
{%- set ns.multi_step_tool = false %}
{%- set ns.last_query_index = index %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set reasoning = '' %}
{%- if message.reasoning_content is string %}
{%- set reasoning = message.reasoning_content %}
{%- elif '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
{%- else %}
{{- '<|im_start|>assistant\\n' + content }}
{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- if loop.first and content or not loop.first %}{{- '\\n' }}{%- endif %}
{%- set call = call.function if call.function else call %}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{{- call.arguments if call.arguments is string else call.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}
{%- elif OPENS_THINKING %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""


def make_reasoning_model(out_dir: Path, opens_thinking: bool = False, script: str | None = None) -> Path:
    """``script``: the text that greedy decoding writes after any prompt (init_model's option)."""
    out = init_model(out_dir, "qwen3_moe", "tiny", seed=0, script=script)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TAGS])
    tokenizer.save(str(out / "tokenizer.json"))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    opens = "true" if opens_thinking else "false"
    config["chat_template"] = QWEN3_LIKE_TEMPLATE.strip().replace("OPENS_THINKING", opens)
    config_path.write_text(json.dumps(config, indent=2))
    return out
