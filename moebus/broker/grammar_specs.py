"""What a structured-output request asks for (protocol.Constraint), as an llguidance grammar.

JSON is generated without free whitespace (separators "," and ":", nothing between tokens): a
bounded schema (enums, integer ranges, maxLength, maxItems) then has a bounded longest answer, so it
completes within max_tokens even when the model's preferences are noise. Tool calls follow the
Hermes / Qwen form that the chat templates teach and api/tool_calls.py parses:
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (the name first, so a stream can
name the call before its arguments)."""
from __future__ import annotations

import json

import llguidance

from moebus.common.errors import RequestError
from moebus.common.protocol import Constraint

JSON_OPTIONS = {"whitespace_flexible": False}  # "," and ":" with nothing around them
CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
MAX_CHOICES = 256


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar (JSON text) of a constraint; RequestError (400) naming what is wrong
    with its spec. Whether the grammar compiles is the matcher's to say (broker/grammar.py)."""
    kind, spec = constraint.kind, constraint.spec
    if kind == "json_object":
        return _from_schema({"type": "object"}, constraint.param)
    if kind == "json_schema":
        _json(spec, constraint.param)  # a 400 for text that is not JSON, before llguidance reads it
        return _from_schema(spec, constraint.param)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(_choice_lark(_json(spec, constraint.param), constraint.param))
    return llguidance.LLMatcher.grammar_from_lark(tool_calls_lark(_json(spec, constraint.param), constraint.param))


def _json(spec: str, param: str):
    try:
        return json.loads(spec)
    except (ValueError, RecursionError) as e:
        raise RequestError(f"{param}: not valid JSON: {str(e)[:200]}", param=param) from None


def _from_schema(schema: dict | str, param: str) -> str:
    """``schema`` as JSON text where it came so: llguidance's parser bounds its nesting (a dict would
    be converted recursively)."""
    if not isinstance(schema, dict) and not (isinstance(schema, str) and schema.lstrip().startswith("{")):
        raise RequestError(f"{param}: a JSON schema must be an object", param=param)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, RecursionError) as e:
        raise RequestError(f"{param}: {str(e)[:300]}", param=param) from None


def _literal(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text)


def _choice_lark(choices, param: str) -> str:
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
        raise RequestError(f"{param}: a non-empty list of non-empty strings", param=param)
    if len(choices) > MAX_CHOICES:
        raise RequestError(f"{param}: at most {MAX_CHOICES} choices", param=param)
    return "start: " + " | ".join(_literal(c) for c in choices)


def call_schema(tool: dict, key: str, defs: dict) -> dict:
    """The JSON object of one call of ``tool``: its name, then arguments under its parameters schema
    (any object when the tool has none, or is not strict and the call is not forced). The schema
    moves into ``defs`` under ``key`` (with its own $defs), its references rewritten to match: each
    tool's "#/..." pointed at its own root, which is no longer the root of the call's schema."""
    parameters = tool.get("parameters") if tool.get("constrain", True) else None
    if isinstance(parameters, dict) and parameters:
        parameters = dict(parameters)
        for name in ("$defs", "definitions"):
            for sub, schema in (parameters.pop(name, None) or {}).items():
                defs[f"{key}_{name.strip('$')}_{sub}"] = _rebased(schema, key)
        defs[key] = _rebased(parameters, key)
        arguments = {"$ref": f"#/$defs/{key}"}
    else:
        arguments = {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": tool["name"]}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def _rebased(schema, key: str):
    """``schema`` with its "#..." references pointing where call_schema moved its root and $defs."""
    if isinstance(schema, list):
        return [_rebased(s, key) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _rebased(v, key) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        for name in ("$defs", "definitions"):
            if ref.startswith(f"#/{name}/"):
                out["$ref"] = f"#/$defs/{key}_{name.strip('$')}_{ref[len(name) + 3:]}"
                break
        else:
            out["$ref"] = f"#/$defs/{key}{ref[1:]}"
    return out


def tool_calls_lark(spec, param: str) -> str:
    """``choice`` "required": one call of any tool; a tool's name: one call of that tool; "auto":
    free text or one call (strict tools' arguments under their schemas), never a call that is not
    well-formed. A forced call's arguments follow the tool's schema, strict or not (as OpenAI's)."""
    if not isinstance(spec, dict) or not isinstance(spec.get("tools"), list) or not spec["tools"]:
        raise RequestError(f"{param}: tools to call are missing", param=param)
    tools, choice = spec["tools"], spec.get("choice")
    if choice not in ("required", "auto"):
        tools = [t for t in tools if t.get("name") == choice]
        if not tools:
            raise RequestError(f"tool_choice names {choice!r}, which is not one of the tools", param="tool_choice")
    if not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools):
        raise RequestError(f"{param}: each tool needs a name", param=param)
    forced = choice != "auto"
    defs: dict = {}
    schemas = [call_schema({**t, "constrain": forced or bool(t.get("strict"))}, f"tool{i}", defs)
               for i, t in enumerate(tools)]
    schema = {"x-guidance": JSON_OPTIONS, **(schemas[0] if len(schemas) == 1 else {"anyOf": schemas}),
              **({"$defs": defs} if defs else {})}
    call = f"call: {_literal(CALL_OPEN)} %json {json.dumps(schema)} {_literal(CALL_CLOSE)}"
    if forced:
        return f"start: call\n{call}"
    # free text that never opens a call, optionally followed by one well-formed call
    return ("start: TEXT | TEXT? call\n"
            f"TEXT: /(?s:.+)/ & ~/(?s:.*){_regex_literal(CALL_OPEN.strip())}(?s:.*)/\n{call}")


def _regex_literal(text: str) -> str:
    """``text`` matched literally inside a Lark /regex/ (``\\<`` would be a word boundary there)."""
    return "".join("\\" + c if c in r".^$*+?()[]{}|\/" else c for c in text)
