"""``response_format`` and vLLM's ``guided_*`` / ``structured_outputs``: the output constraint a
request asks for, validated (an invalid value or an unenforceable schema keyword is a 400)."""

from __future__ import annotations

import json
from typing import Any

from proxy.sampling import StructuredOutputParams
from proxy.tools.request.field_errors import bad_field, json_kind
from proxy.tools.schema import check_json_schema

__all__ = ["parse_structured_outputs"]

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _response_format(value: Any) -> StructuredOutputParams | None:
    if not isinstance(value, dict):
        raise bad_field("response_format", f"'response_format' must be an object, not {json_kind(value)}.")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputParams("json_object")
    if kind == "json_schema":
        js = value.get("json_schema")
        if not isinstance(js, dict):
            raise bad_field("response_format.json_schema", "'response_format.json_schema' must be an "
                            "object with 'name' and 'schema'.")
        name = js.get("name")
        if name is not None and not isinstance(name, str):
            raise bad_field(
                "response_format.json_schema.name", "'response_format.json_schema.name' must be a string."
            )
        schema = js.get("schema", {"type": "object"})
        param = "response_format.json_schema.schema"
        if not isinstance(schema, dict):
            raise bad_field(param, f"'{param}' must be a JSON Schema object, not {json_kind(schema)}.")
        check_json_schema(schema, param)
        return StructuredOutputParams("json", json.dumps(schema, ensure_ascii=False))
    raise bad_field("response_format.type", "'response_format.type' must be one of 'text', "
                    f"'json_object', 'json_schema'; got {kind!r}.")


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
                    raise bad_field(key, f"'{key}' must be a JSON Schema (object or JSON text).") from None
            if not isinstance(value, dict):
                raise bad_field(key, f"'{key}' must be a JSON Schema object, not {json_kind(value)}.")
            check_json_schema(value, key)
            found.append((StructuredOutputParams("json", json.dumps(value, ensure_ascii=False)), key))
        elif kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise bad_field(key, f"'{key}' must be a non-empty array of non-empty strings.")
            found.append((StructuredOutputParams("choice", json.dumps(value, ensure_ascii=False)), key))
        else:
            if not isinstance(value, str) or not value:
                raise bad_field(key, f"'{key}' must be a non-empty string.")
            found.append((StructuredOutputParams(kind, value), key))  # type: ignore[arg-type]
    so_extra = body.get("structured_outputs")
    if so_extra is not None:
        if not isinstance(so_extra, dict):
            raise bad_field("structured_outputs", "'structured_outputs' must be an object.")
        inner = {f"guided_{k}": v for k, v in so_extra.items() if k in ("json", "regex", "choice", "grammar")}
        if len(inner) != 1:
            raise bad_field("structured_outputs", "'structured_outputs' must set exactly one of 'json', "
                            "'regex', 'choice', 'grammar'.")
        so, _ = parse_structured_outputs(inner)
        assert so is not None
        found.append((so, "structured_outputs"))
    if len(found) > 1:
        raise bad_field(found[1][1], f"'{found[0][1]}' and '{found[1][1]}' cannot be used together.")
    return (found[0][0], found[0][1]) if found else (None, None)
