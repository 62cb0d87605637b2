"""The OpenAI request fields of tool calling and structured outputs: validation, prompts, grammars.

Covers ``response_format`` (``text``, ``json_object``, ``json_schema``), ``tools``, ``tool_choice``
(``"none"``, ``"auto"``, ``"required"``, ``{"type": "function", "function": {"name"}}``),
``parallel_tool_calls``, vLLM's extras ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` / ``structured_outputs``, and the chat history of an agent loop (assistant
messages with ``tool_calls``, ``tool`` messages with ``tool_call_id``). Every invalid value is an
:class:`~proxy.errors.InvalidRequestError` (400) whose ``param`` names the field.

How a tool choice is served (as vLLM does):

- ``"none"``: plain text; tools are still shown to the template.
- ``"auto"``: the model decides; its output is parsed by a :class:`~proxy.tools.ToolCallParser`
  (the template's format, or on a template without tool support the format the system prompt
  teaches, as llama.cpp's server serves tools on any template).
- ``"required"``: the output is constrained by a grammar to a JSON array of
  ``{"name": <a tool>, "parameters": <its schema>}`` (one element when ``parallel_tool_calls`` is
  false), so even a small model returns calls whose arguments validate.
- a named function: the output is constrained to that function's ``parameters`` schema; it is the
  arguments object itself.

On a chat template without tool support, :func:`tool_system_prompt` describes the tools in a system
message (the README documents its text): for ``"required"`` and named choices the JSON the grammar
forces; for ``"auto"`` one tool-call format that a parser reads (``hermes``'s ``<tool_call>`` unless
``--tool-call-parser`` names another), with no grammar, so the model may answer in text instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from proxy.errors import InvalidRequestError
from proxy.sampling import StructuredOutputParams
from proxy.tools.parsers import CALL_SHAPES, ToolCall, format_calls, new_call_id
from proxy.tools.schema import check_json_schema

__all__ = [
    "ChatTools",
    "ToolChoice",
    "ToolSpec",
    "parse_chat_tools",
    "parse_structured_outputs",
    "template_messages",
    "tool_system_prompt",
]

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _bad(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number" if isinstance(value, (int, float)) else type(value).__name__
    )


# ---- response_format and vLLM's guided_* ---------------------------------------------------------


def _response_format(value: Any) -> StructuredOutputParams | None:
    if not isinstance(value, dict):
        raise _bad("response_format", f"'response_format' must be an object, not {_kind(value)}.")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputParams("json_object")
    if kind == "json_schema":
        js = value.get("json_schema")
        if not isinstance(js, dict):
            raise _bad("response_format.json_schema", "'response_format.json_schema' must be an object "
                       "with 'name' and 'schema'.")
        name = js.get("name")
        if name is not None and not isinstance(name, str):
            raise _bad(
                "response_format.json_schema.name", "'response_format.json_schema.name' must be a string."
            )
        schema = js.get("schema", {"type": "object"})
        param = "response_format.json_schema.schema"
        if not isinstance(schema, dict):
            raise _bad(param, f"'{param}' must be a JSON Schema object, not {_kind(schema)}.")
        check_json_schema(schema, param)
        return StructuredOutputParams("json", json.dumps(schema, ensure_ascii=False))
    raise _bad("response_format.type", "'response_format.type' must be one of 'text', 'json_object', "
               f"'json_schema'; got {kind!r}.")


def parse_structured_outputs(body: dict[str, Any]) -> tuple[StructuredOutputParams | None, str | None]:
    """The output constraint a request asks for with ``response_format`` or vLLM's extras.

    Returns:
        ``(params, field)``: the constraint (None: unconstrained) and the field that asked for it
        (the ``param`` to name when compiling it fails).

    Raises:
        InvalidRequestError: an invalid value, an unsupported schema keyword, or two fields at once.
    """
    found: list[tuple[StructuredOutputParams, str]] = []
    if body.get("response_format") is not None:
        so = _response_format(body["response_format"])
        if so is not None:
            found.append((so, "response_format"))
    for key, kind in _GUIDED.items():
        value = body.get(key)
        if value is None:
            continue
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    raise _bad(key, f"'{key}' must be a JSON Schema (object or JSON text).") from None
            if not isinstance(value, dict):
                raise _bad(key, f"'{key}' must be a JSON Schema object, not {_kind(value)}.")
            check_json_schema(value, key)
            found.append((StructuredOutputParams("json", json.dumps(value, ensure_ascii=False)), key))
        elif kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise _bad(key, f"'{key}' must be a non-empty array of non-empty strings.")
            found.append((StructuredOutputParams("choice", json.dumps(value, ensure_ascii=False)), key))
        else:
            if not isinstance(value, str) or not value:
                raise _bad(key, f"'{key}' must be a non-empty string.")
            found.append((StructuredOutputParams(kind, value), key))  # type: ignore[arg-type]
    so_extra = body.get("structured_outputs")
    if so_extra is not None:
        if not isinstance(so_extra, dict):
            raise _bad("structured_outputs", "'structured_outputs' must be an object.")
        inner = {f"guided_{k}": v for k, v in so_extra.items() if k in ("json", "regex", "choice", "grammar")}
        if len(inner) != 1:
            raise _bad("structured_outputs", "'structured_outputs' must set exactly one of 'json', 'regex', "
                       "'choice', 'grammar'.")
        so, _ = parse_structured_outputs(inner)
        assert so is not None
        found.append((so, "structured_outputs"))
    if len(found) > 1:
        raise _bad(found[1][1], f"'{found[0][1]}' and '{found[1][1]}' cannot be used together.")
    return (found[0][0], found[0][1]) if found else (None, None)


# ---- tools and tool_choice ------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolSpec:
    """One ``tools[i]`` entry of type ``function``.

    Attributes:
        name: the function name.
        description: its description ("" when absent).
        parameters: the JSON Schema of its arguments (``{"type": "object", "properties": {}}`` when absent).
        index: its position in ``tools`` (for error messages).
    """

    name: str
    description: str
    parameters: dict[str, Any]
    index: int

    def to_template(self) -> dict[str, Any]:
        """The OpenAI tool object as chat templates expect it (``apply_chat_template(tools=...)``)."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    """``tool_choice``: ``mode`` is ``none``, ``auto``, ``required`` or ``named`` (then ``name`` is set)."""

    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None


@dataclass(frozen=True)
class ChatTools:
    """The tool part of a chat request.

    Attributes:
        tools: the declared functions.
        choice: how they may be used.
        parallel: ``parallel_tool_calls`` (default True): more than one call per answer.
    """

    tools: tuple[ToolSpec, ...]
    choice: ToolChoice
    parallel: bool = True

    @property
    def is_constrained(self) -> bool:
        """True when the output is forced into calls by a grammar (``required`` or named)."""
        return self.choice.mode in ("required", "named")

    @property
    def is_parsed(self) -> bool:
        """True when the output goes through a tool-call parser (``auto``)."""
        return self.choice.mode == "auto"

    def template_tools(self) -> list[dict[str, Any]]:
        """The tool objects for ``apply_chat_template(tools=...)``: for a named choice only that function."""
        chosen = [t for t in self.tools if self.choice.mode != "named" or t.name == self.choice.name]
        return [t.to_template() for t in chosen]

    def _tool(self, name: str) -> ToolSpec:
        return next(t for t in self.tools if t.name == name)

    def grammar(self) -> StructuredOutputParams | None:
        """The output constraint of a ``required`` or named choice (None otherwise).

        Raises:
            InvalidRequestError: a tool's ``parameters`` uses a schema keyword the grammar cannot enforce.
        """
        if self.choice.mode == "named":
            assert self.choice.name is not None
            tool = self._tool(self.choice.name)
            check_json_schema(tool.parameters, f"tools[{tool.index}].function.parameters")
            return StructuredOutputParams("json", json.dumps(tool.parameters, ensure_ascii=False))
        if self.choice.mode != "required":
            return None
        options = []
        for tool in self.tools:
            check_json_schema(tool.parameters, f"tools[{tool.index}].function.parameters")
            options.append({
                "type": "object",
                "properties": {"name": {"const": tool.name}, "parameters": tool.parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            })
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": options}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputParams("json", json.dumps(schema, ensure_ascii=False))

    def calls_from_output(self, text: str) -> list[ToolCall] | None:
        """The calls of a constrained (``required`` / named) output, or None when it is not complete
        JSON (``max_tokens`` cut it: the text is then returned as content)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.choice.mode == "named":
            if not isinstance(value, dict):
                return None
            assert self.choice.name is not None
            return [ToolCall(new_call_id(), self.choice.name, json.dumps(value, ensure_ascii=False))]
        if not isinstance(value, list):
            return None
        calls = []
        for item in value:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            calls.append(ToolCall(new_call_id(), item["name"],
                                  json.dumps(item.get("parameters", {}), ensure_ascii=False)))
        return calls


def _tool_spec(value: Any, i: int) -> ToolSpec:
    p = f"tools[{i}]"
    if not isinstance(value, dict):
        raise _bad(p, f"'{p}' must be an object, not {_kind(value)}.")
    if value.get("type", "function") != "function":
        raise _bad(f"{p}.type", f"'{p}.type' must be 'function'; got {value.get('type')!r}.")
    fn = value.get("function")
    if not isinstance(fn, dict):
        raise _bad(f"{p}.function", f"'{p}.function' is required and must be an object.")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(f"{p}.function.name", f"'{p}.function.name' is required and must be a non-empty string.")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise _bad(f"{p}.function.description", f"'{p}.function.description' must be a string.")
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise _bad(f"{p}.function.parameters", f"'{p}.function.parameters' must be a JSON Schema object, "
                   f"not {_kind(parameters)}.")
    return ToolSpec(name, description, parameters, i)


def parse_chat_tools(body: dict[str, Any]) -> ChatTools | None:
    """Validate ``tools``, ``tool_choice`` and ``parallel_tool_calls``.

    Returns:
        None when the request declares no tools (``tool_choice`` absent or ``"none"``), else the tools.

    Raises:
        InvalidRequestError: ``tools`` not an array of function tools, duplicate names,
            ``tool_choice`` without ``tools``, an unknown mode or function name,
            ``parallel_tool_calls`` not a boolean, or the legacy ``functions`` / ``function_call``.
    """
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise _bad(legacy, f"'{legacy}' is deprecated and not supported; use 'tools' and 'tool_choice'.")
    tools_value = body.get("tools")
    choice_value = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "'parallel_tool_calls' must be a boolean.")
    if tools_value is None or tools_value == []:
        if choice_value not in (None, "none"):
            raise _bad("tool_choice", "'tool_choice' is only allowed when 'tools' are specified.")
        return None
    if not isinstance(tools_value, list):
        raise _bad("tools", f"'tools' must be an array, not {_kind(tools_value)}.")
    tools = tuple(_tool_spec(t, i) for i, t in enumerate(tools_value))
    seen: set[str] = set()
    for t in tools:
        if t.name in seen:
            raise _bad(f"tools[{t.index}].function.name", f"Duplicate tool name {t.name!r}.")
        seen.add(t.name)
    if choice_value is None:
        choice = ToolChoice("auto")
    elif isinstance(choice_value, str):
        if choice_value not in ("none", "auto", "required"):
            raise _bad("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                       f"{{'type': 'function', 'function': {{'name': ...}}}}; got {choice_value!r}.")
        choice = ToolChoice(choice_value)  # type: ignore[arg-type]
    elif isinstance(choice_value, dict):
        fn = choice_value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice_value.get("type", "function") != "function" or not isinstance(name, str):
            raise _bad("tool_choice", "'tool_choice' must name a function: "
                       "{'type': 'function', 'function': {'name': ...}}.")
        if name not in seen:
            raise _bad(
                "tool_choice.function.name",
                f"'tool_choice' names the function {name!r}, which is not "
                f"in 'tools' ({', '.join(sorted(seen))}).",
            )
        choice = ToolChoice("named", name)
    else:
        raise _bad("tool_choice", f"'tool_choice' must be a string or an object, not {_kind(choice_value)}.")
    return ChatTools(tools, choice, parallel)


def tool_system_prompt(tools: ChatTools, parser_name: str | None = None) -> str:
    """The system text that presents the tools when the chat template cannot (no tool support).

    Args:
        tools: the request's tools; ``required`` and named choices get the shape their grammar
            forces, ``auto`` the call format of ``parser_name``.
        parser_name: the tool-call parser that reads an ``auto`` answer (``hermes`` when None).
    """
    listing = "\n".join(json.dumps(t.to_template()["function"], ensure_ascii=False) for t in tools.tools
                        if tools.choice.mode != "named" or t.name == tools.choice.name)
    if tools.choice.mode == "named":
        return (
            f"You have access to the following function:\n{listing}\n"
            f"Call the function {tools.choice.name} now: answer only with its arguments as a JSON object."
        )
    if tools.choice.mode == "auto":
        shape = CALL_SHAPES[parser_name or "hermes"]
        return (
            f"You have access to the following functions:\n{listing}\n"
            f"To call a function, answer with\n{shape}\nIf no function is needed, answer the user directly."
        )
    return (f"You have access to the following functions:\n{listing}\n"
            'Call one or more of them now: answer only with a JSON array of calls, each '
            '{"name": <function name>, "parameters": <arguments object>}.')


# ---- messages of an agent loop ---------------------------------------------------------------------


def template_messages(
    messages: list[dict[str, Any]],
    raw: list[Any],
    *,
    template_has_tools: bool,
    call_format: str | None = None,
) -> list[dict[str, Any]]:
    """Messages for the chat template, with the tool parts of ``raw`` (the request's messages) added.

    Args:
        messages: the validated ``{"role", "content"}`` messages, in order (one per raw message);
            ``content`` of an assistant message with tool calls may be "" (OpenAI sends null).
        raw: the request's ``messages`` array, for ``tool_calls`` and ``tool_call_id``.
        template_has_tools: the template renders ``tool_calls`` and ``tool`` messages itself.
        call_format: for a template without tool support, the parser whose format earlier calls
            are written in (what :func:`tool_system_prompt` taught for ``auto``); None: the JSON
            array that ``required`` asks for.

    Returns:
        New message dicts: assistant ``tool_calls`` with ``function.arguments`` as objects (what
        transformers' templates expect), ``tool`` messages with ``tool_call_id`` (and ``name`` when
        known). For a template without tool support, an assistant's calls are written into its
        content (``call_format``'s text, else a JSON array), and ``content`` is always a string
        (templates concatenate it).

    Raises:
        InvalidRequestError: a malformed ``tool_calls`` entry, or a ``tool`` message without
            ``tool_call_id``.
    """
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for i, (msg, src) in enumerate(zip(messages, raw)):
        msg = dict(msg)
        p = f"messages[{i}]"
        if msg.get("content") is None:
            msg["content"] = ""
        if msg["role"] == "assistant" and src.get("tool_calls"):
            calls = _tool_calls(src["tool_calls"], f"{p}.tool_calls")
            for c in calls:
                names[c["id"]] = c["function"]["name"]
            if template_has_tools:
                msg["tool_calls"] = calls
            else:
                pairs = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
                text = (format_calls(call_format, pairs) if call_format is not None else
                        json.dumps([{"name": n, "parameters": a} for n, a in pairs], ensure_ascii=False))
                msg["content"] = (msg["content"] + "\n" if msg["content"] else "") + text
        elif msg["role"] == "tool":
            call_id = src.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise _bad(f"{p}.tool_call_id", f"'{p}.tool_call_id' is required for role 'tool'.")
            msg["tool_call_id"] = call_id
            if call_id in names:
                msg.setdefault("name", names[call_id])
        out.append(msg)
    return out


def _tool_calls(value: Any, p: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise _bad(p, f"'{p}' must be an array.")
    calls = []
    for j, call in enumerate(value):
        q = f"{p}[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise _bad(q, f"'{q}' must be an object with 'function'.")
        fn = call["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"{q}.function.name", f"'{q}.function.name' is required.")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise _bad(
                    f"{q}.function.arguments", f"'{q}.function.arguments' must be JSON text."
                ) from None
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise _bad(f"{q}.id", f"'{q}.id' must be a string.")
        calls.append({"id": call_id or f"call_{j}", "type": "function",
                      "function": {"name": name, "arguments": args}})
    return calls
