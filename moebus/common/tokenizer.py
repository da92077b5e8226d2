"""Tokenizer of a model directory: ``tokenizer.json`` through the ``tokenizers`` library, the chat
template of ``tokenizer_config.json`` rendered with jinja2 (sandboxed), and the stop ids from
``generation_config.json`` / ``config.json``. A directory without a chat template still serves
token-id and plain-text prompts."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from moebus.common.errors import CheckpointError, RequestError


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path}: not valid JSON: {e}") from e


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _raise(message):
    raise RequestError(f"chat template: {message}", param="messages")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """Templates are written against transformers' ``tojson``: plain json.dumps, no HTML escaping
    and no key sorting (jinja2's own filter does both, which would change the prompt)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_: str) -> str:
    return datetime.now().strftime(format_)


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


class TextTokenizer:
    def __init__(self, model_dir: str | Path, eos_token_ids: tuple[int, ...] = ()):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: not found (moebus reads fast tokenizers only)")
        self.tokenizer = Tokenizer.from_file(str(path))
        tok_cfg = _read_json(model_dir / "tokenizer_config.json")
        gen_cfg = _read_json(model_dir / "generation_config.json")
        self.bos_token = _token_text(tok_cfg.get("bos_token"))
        self.eos_token = _token_text(tok_cfg.get("eos_token"))
        self.chat_template = self._pick_template(tok_cfg.get("chat_template"), model_dir)
        stop = set(eos_token_ids)
        gen_eos = gen_cfg.get("eos_token_id")
        stop.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        if self.eos_token and self.tokenizer.token_to_id(self.eos_token) is not None:
            stop.add(self.tokenizer.token_to_id(self.eos_token))
        self.stop_ids = frozenset(int(i) for i in stop)
        # the environment that transformers' apply_chat_template renders in, so prompts match it
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                  extensions=["jinja2.ext.loopcontrols"])
        self._env.globals["raise_exception"] = _raise
        self._env.globals["strftime_now"] = _strftime_now
        self._env.filters["tojson"] = _tojson
        self._compiled = self._env.from_string(self.chat_template) if self.chat_template else None

    @staticmethod
    def _pick_template(value, model_dir: Path) -> str | None:
        if isinstance(value, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in value}
            value = named.get("default") or next(iter(named.values()), None)
        if value is None and (model_dir / "chat_template.jinja").is_file():
            value = (model_dir / "chat_template.jinja").read_text()
        return value

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL (encode does not): a 4 MiB prompt tokenized in a thread of
        # the broker takes seconds, and the broker's loop must keep running meanwhile
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> str:
        """The prompt text. ``tools`` (OpenAI tool definitions) and ``template_kwargs`` (e.g. Qwen3's
        ``enable_thinking``) reach the template as variables, as transformers passes them."""
        if self._compiled is None:
            raise RequestError("this model has no chat template; use /v1/completions", param="messages")
        extra = dict(template_kwargs or {})
        clash = sorted(RESERVED_TEMPLATE_NAMES & set(extra))
        if clash:
            raise RequestError(f"chat_template_kwargs may not set {clash[0]!r}",
                               param=f"chat_template_kwargs.{clash[0]}")
        return self._compiled.render(**extra, messages=messages, add_generation_prompt=add_generation_prompt,
                                     tools=tools, bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
        return self.encode(self.render_chat(messages, tools=tools, template_kwargs=template_kwargs))

    @property
    def emits_reasoning(self) -> bool:
        """Does the chat template know ``<think>`` blocks (Qwen3, DeepSeek-R1 and their kind)?"""
        return bool(self.chat_template) and THINK_OPEN in self.chat_template

    def opens_reasoning(self, prompt_text: str) -> bool | None:
        """For a rendered chat prompt: True when it ends inside an open ``<think>`` block (the answer
        begins as reasoning), False when not, None when the model has no reasoning blocks."""
        if not self.emits_reasoning:
            return None
        return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


class StreamDecoder:
    """Turns a growing list of token ids into text deltas, holding back an incomplete UTF-8 tail.
    Each push decodes only a short window (the tokens since the last emitted text, and those of
    the last delta for context), so a stream costs O(new tokens), not O(sequence) per token."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] were emitted already (context)
        self.read_offset = 0  # ids[read_offset:] are not emitted yet

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix, text = self._window()
        if len(text) <= len(prefix) or text.endswith("\ufffd") or not text.startswith(prefix):
            return ""  # an incomplete character, or a merge that changed earlier text: wait
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix):]

    def flush(self) -> str:
        """The rest of the text at the end of a sequence, an incomplete character included."""
        prefix, text = self._window()
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):] if text.startswith(prefix) else ""

    def _window(self) -> tuple[str, str]:
        decode = self.tokenizer.decode
        return (decode(self.ids[self.prefix_offset:self.read_offset]), decode(self.ids[self.prefix_offset:]))
