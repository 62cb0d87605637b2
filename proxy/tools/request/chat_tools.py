"""``tools``, ``tool_choice`` and ``parallel_tool_calls``: the declared functions and how they may
be used, validated, and the grammar a ``required`` or named choice constrains the output with."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from proxy.sampling import StructuredOutputParams
from proxy.tools.parsers import ToolCall, new_call_id
from proxy.tools.request.field_errors import bad_field, json_kind
from proxy.tools.schema import check_json_schema, rebase_local_refs

__all__ = ["ChatTools", "ToolChoice", "ToolSpec", "parse_chat_tools"]


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
        defs: dict[str, Any] = {}
        for tool in self.tools:
            check_json_schema(tool.parameters, f"tools[{tool.index}].function.parameters")
            parameters = tool.parameters
            key = f"tool_{tool.index}"
            rebased = rebase_local_refs(parameters, f"#/$defs/{key}")
            if rebased != parameters:  # it has local references: under the array's root they resolve
                defs[key] = rebased
                parameters = {"$ref": f"#/$defs/{key}"}
            options.append({
                "type": "object",
                "properties": {"name": {"const": tool.name}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            })
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": options}, "minItems": 1}
        if defs:
            schema["$defs"] = defs
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
        raise bad_field(p, f"'{p}' must be an object, not {json_kind(value)}.")
    if value.get("type", "function") != "function":
        raise bad_field(f"{p}.type", f"'{p}.type' must be 'function'; got {value.get('type')!r}.")
    fn = value.get("function")
    if not isinstance(fn, dict):
        raise bad_field(f"{p}.function", f"'{p}.function' is required and must be an object.")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise bad_field(
            f"{p}.function.name", f"'{p}.function.name' is required and must be a non-empty string."
        )
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise bad_field(f"{p}.function.description", f"'{p}.function.description' must be a string.")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_field(f"{p}.function.strict", f"'{p}.function.strict' must be a boolean, not "
                        f"{json_kind(strict)}.")
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise bad_field(f"{p}.function.parameters", f"'{p}.function.parameters' must be a JSON Schema "
                        f"object, not {json_kind(parameters)}.")
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
            raise bad_field(
                legacy, f"'{legacy}' is deprecated and not supported; use 'tools' and 'tool_choice'."
            )
    tools_value = body.get("tools")
    choice_value = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise bad_field("parallel_tool_calls", "'parallel_tool_calls' must be a boolean.")
    if tools_value is None or tools_value == []:
        if choice_value not in (None, "none"):
            raise bad_field("tool_choice", "'tool_choice' is only allowed when 'tools' are specified.")
        return None
    if not isinstance(tools_value, list):
        raise bad_field("tools", f"'tools' must be an array, not {json_kind(tools_value)}.")
    tools = tuple(_tool_spec(t, i) for i, t in enumerate(tools_value))
    seen: set[str] = set()
    for t in tools:
        if t.name in seen:
            raise bad_field(f"tools[{t.index}].function.name", f"Duplicate tool name {t.name!r}.")
        seen.add(t.name)
    if choice_value is None:
        choice = ToolChoice("auto")
    elif isinstance(choice_value, str):
        if choice_value not in ("none", "auto", "required"):
            raise bad_field("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                            f"{{'type': 'function', 'function': {{'name': ...}}}}; got {choice_value!r}.")
        choice = ToolChoice(choice_value)  # type: ignore[arg-type]
    elif isinstance(choice_value, dict):
        fn = choice_value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice_value.get("type", "function") != "function" or not isinstance(name, str):
            raise bad_field("tool_choice", "'tool_choice' must name a function: "
                            "{'type': 'function', 'function': {'name': ...}}.")
        if name not in seen:
            raise bad_field(
                "tool_choice.function.name",
                f"'tool_choice' names the function {name!r}, which is not "
                f"in 'tools' ({', '.join(sorted(seen))}).",
            )
        choice = ToolChoice("named", name)
    else:
        raise bad_field(
            "tool_choice", f"'tool_choice' must be a string or an object, not {json_kind(choice_value)}."
        )
    return ChatTools(tools, choice, parallel)

