"""Structured-output fields of a request, turned into the one grammar constraint it sends the broker
(protocol.Constraint; the broker compiles it, broker/grammar.py):

- OpenAI's ``response_format``: ``{"type": "json_object"}`` and ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict", "description"}}`` (the schema is enforced whether or
  not ``strict`` is set, as vLLM does);
- ``tool_choice`` ``"required"`` or ``{"type": "function", "function": {"name": ...}}``: the answer is
  one call, its arguments under the tool's ``parameters``; ``"auto"`` with a ``strict: true`` tool:
  free text or a call whose arguments follow that tool's schema;
- vLLM's ``guided_json``, ``guided_regex``, ``guided_choice`` (sent through ``extra_body``).

At most one of these per request. vLLM's other guided fields and llama.cpp's ``grammar`` /
``json_schema`` are refused with a 400 (schemas.NOT_IMPLEMENTED)."""
from __future__ import annotations

import json

from moebus.common.errors import RequestError
from moebus.common.protocol import MAX_CONSTRAINT_CHARS

GUIDED = ("guided_json", "guided_regex", "guided_choice")
JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def _spec(value, param: str) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise RequestError(f"{param}: {len(text)} characters; at most {MAX_CONSTRAINT_CHARS}", param=param,
                           code="grammar_too_large")
    return text


def response_format_constraint(fmt: dict | None) -> dict | None:
    """The constraint of ``response_format`` (None for text); a 400 for any other shape."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    extra = set(fmt) - {"type", "json_schema"}
    if kind == "text" and set(fmt) == {"type"}:
        return None
    if kind == "json_object" and set(fmt) == {"type"}:
        return {"kind": "json_object", "param": "response_format"}
    if kind != "json_schema" or extra:
        raise RequestError(f"response_format: type must be 'text', 'json_object' or 'json_schema' (with "
                           f"'json_schema'), got {str(kind)[:40]!r}", param="response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or set(spec) - JSON_SCHEMA_KEYS:
        raise RequestError(f"response_format.json_schema: an object with keys among {sorted(JSON_SCHEMA_KEYS)}",
                           param="response_format.json_schema")
    name = spec.get("name")
    if not (isinstance(name, str) and 0 < len(name) <= 64):
        raise RequestError("response_format.json_schema.name: a string of 1 to 64 characters",
                           param="response_format.json_schema.name")
    if spec.get("strict") not in (None, True, False):
        raise RequestError("response_format.json_schema.strict must be a boolean",
                           param="response_format.json_schema.strict")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise RequestError("response_format.json_schema.schema must be an object",
                           param="response_format.json_schema.schema")
    param = "response_format.json_schema.schema"
    return {"kind": "json_schema", "spec": _spec(schema, param), "param": param}


def check_tool_choice(choice, tool_names: list[str]) -> None:
    """"auto", "none", "required" or a named function among the tools; a 400 otherwise."""
    if choice in (None, "auto", "none"):
        return
    if choice == "required":
        if not tool_names:
            raise RequestError("tool_choice 'required' needs tools", param="tool_choice")
        return
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)
            and set(choice) == {"type", "function"} and set(choice["function"]) == {"name"}):
        raise RequestError("tool_choice: 'auto', 'none', 'required' or {'type': 'function', 'function': "
                           "{'name': ...}}", param="tool_choice")
    if name not in tool_names:
        raise RequestError(f"tool_choice names {name[:64]!r}, which is not one of the tools", param="tool_choice")


def tools_constraint(tools: list[dict], choice) -> dict | None:
    """The constraint of a forced call, or of ``auto`` with strict tools; None otherwise."""
    if not tools or choice == "none":
        return None
    mode = choice["function"]["name"] if isinstance(choice, dict) else (choice or "auto")
    if mode == "auto" and not any(t["function"].get("strict") for t in tools):
        return None
    calls = [{"name": t["function"]["name"], "parameters": t["function"].get("parameters"),
              "strict": bool(t["function"].get("strict"))} for t in tools]
    return {"kind": "tool_calls", "spec": _spec({"tools": calls, "choice": mode}, "tools"), "param": "tools"}


def guided_constraint(body) -> dict | None:
    """vLLM's guided_json (a schema, or its JSON text), guided_regex, guided_choice: at most one."""
    given = []
    if body.guided_json is not None:
        if not isinstance(body.guided_json, (dict, str)):
            raise RequestError("guided_json: a JSON schema (an object or its JSON text)", param="guided_json")
        given.append({"kind": "json_schema", "spec": _spec(body.guided_json, "guided_json"), "param": "guided_json"})
    if body.guided_regex is not None:
        given.append({"kind": "regex", "spec": _spec(body.guided_regex, "guided_regex"), "param": "guided_regex"})
    if body.guided_choice is not None:
        given.append({"kind": "choice", "spec": _spec(body.guided_choice, "guided_choice"), "param": "guided_choice"})
    return one_constraint(*given)


def one_constraint(*constraints: dict | None) -> dict | None:
    """The request's constraint; a 400 when it asks for two (e.g. a forced call and a JSON schema)."""
    given = [c for c in constraints if c is not None]
    if len(given) > 1:
        raise RequestError(f"{given[0]['param']} and {given[1]['param']} both constrain the answer; send one",
                           param=given[1]["param"])
    return given[0] if given else None
