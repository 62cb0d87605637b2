"""Which JSON Schemas constrained decoding enforces exactly: the keyword allow-list (stdlib only).

xgrammar 0.2.9 (the grammar library, see :mod:`proxy.engine.structured`) silently ignores some JSON
Schema keywords. Each keyword in :data:`ENFORCED_KEYWORDS` was checked on it: a violating instance is
rejected and a conforming one accepted. Every other keyword that constrains values is refused with a
400 naming it, so a schema is enforced or refused, never silently relaxed.
"""

from __future__ import annotations

from typing import Any

from proxy.errors import InvalidRequestError
from proxy.tools.regex_features import check_regex

__all__ = ["ANNOTATION_KEYWORDS", "ENFORCED_KEYWORDS", "JSON_FORMATS", "check_json_schema",
           "rebase_local_refs"]

ENFORCED_KEYWORDS: frozenset[str] = frozenset({
    "type", "enum", "const",
    "properties", "required", "additionalProperties", "propertyNames",
    "items", "prefixItems", "minItems", "maxItems",
    "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "anyOf", "allOf", "$ref", "$defs", "definitions",
})
"""JSON Schema keywords xgrammar 0.2.9 was checked to enforce (a violating instance is rejected and a
conforming one accepted; ``allOf`` only with one branch). Any other keyword that constrains values is
refused with a 400 naming it."""

ANNOTATION_KEYWORDS: frozenset[str] = frozenset({
    "title", "description", "$schema", "$id", "$comment", "default", "examples", "deprecated",
    "readOnly", "writeOnly", "strict",
})
"""Keywords that do not constrain values (JSON Schema annotations): accepted and ignored."""

JSON_FORMATS: frozenset[str] = frozenset({
    "email", "date", "time", "date-time", "uuid", "ipv4", "uri", "hostname",
})
"""``format`` values xgrammar 0.2.9 was checked to enforce; others are a 400."""

_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames")
_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def rebase_local_refs(schema: Any, base: str) -> Any:
    """A copy of ``schema`` (one :func:`check_json_schema` accepted) in which every local reference
    (``"$ref"``, a JSON pointer into this schema: ``#/$defs/Loc``, ``#/definitions/Loc``, ``#``
    itself) points into ``base`` instead (``#/$defs/tool_0`` + ``/$defs/Loc``): what a schema needs
    once it sits inside another one (``tool_choice: "required"`` wraps each tool's parameters in an
    array schema; pydantic writes every nested model as such a reference). Only the schema
    positions are walked (the keywords of :data:`_SCHEMA_MAPS`, :data:`_SCHEMA_LISTS` and
    :data:`_SCHEMA_VALUES`), so data under ``const`` / ``enum`` / ``default`` / ``examples`` stays
    as written, as do remote references and anchors."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: rebase_local_refs(sub, base) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [rebase_local_refs(sub, base) for sub in value]
        elif key in _SCHEMA_VALUES:
            out[key] = rebase_local_refs(value, base)
        else:
            out[key] = value
    return out


def _refuse(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def check_json_schema(schema: Any, param: str = "response_format.json_schema.schema") -> None:
    """Check that ``schema`` is JSON Schema that the grammar enforces exactly.

    Args:
        schema: the parsed schema (a dict, or ``True``/``False``).
        param: the request field it came from, used in error messages.

    Raises:
        InvalidRequestError: not a JSON Schema object, a keyword outside :data:`ENFORCED_KEYWORDS`
            and :data:`ANNOTATION_KEYWORDS` (the message names it and its path), an ``allOf`` with
            more than one branch, an unknown ``type`` or ``format``, a ``required`` name that is
            not in ``properties``, or a ``pattern`` using a regex feature the grammar cannot enforce
            (:func:`proxy.tools.regex_features.check_regex`: lookaround, backreferences, ...).
    """
    _check(schema, param, "#")


def _check(node: Any, param: str, path: str) -> None:
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise _refuse(
            f"{param}: the schema at {path} must be a JSON object, got {type(node).__name__}", param
        )
    for key, value in node.items():
        where = f"{path}/{key}"
        if key in ANNOTATION_KEYWORDS:
            continue
        if key not in ENFORCED_KEYWORDS:
            raise _refuse(
                f"{param}: the JSON Schema keyword {key!r} (at {path}) is not supported by this server's "
                f"constrained decoding; supported keywords: {', '.join(sorted(ENFORCED_KEYWORDS))}",
                param,
            )
        if key == "type":
            types = value if isinstance(value, list) else [value]
            if not types or any(t not in _TYPES for t in types):
                raise _refuse(f"{param}: invalid JSON Schema type {value!r} at {path}", param)
        elif key == "format" and value not in JSON_FORMATS:
            raise _refuse(
                f"{param}: the string format {value!r} (at {path}) is not supported; supported formats: "
                f"{', '.join(sorted(JSON_FORMATS))}",
                param,
            )
        elif key in _SCHEMA_MAPS:
            if not isinstance(value, dict):
                raise _refuse(f"{param}: {where} must be an object of schemas", param)
            for name, sub in value.items():
                _check(sub, param, f"{where}/{name}")
        elif key in _SCHEMA_LISTS:
            if not isinstance(value, list) or not value:
                raise _refuse(f"{param}: {where} must be a non-empty array of schemas", param)
            if key == "allOf" and len(value) > 1:
                raise _refuse(
                    f"{param}: 'allOf' with more than one schema (at {path}) is not supported; merge them",
                    param,
                )
            for i, sub in enumerate(value):
                _check(sub, param, f"{where}/{i}")
        elif key in _SCHEMA_VALUES:
            _check(value, param, where)
        elif key == "required":
            if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
                raise _refuse(f"{param}: {where} must be an array of property names", param)
            props = node.get("properties", {})
            missing = [n for n in value if not isinstance(props, dict) or n not in props]
            if missing:
                raise _refuse(
                    f"{param}: required property {missing[0]!r} (at {path}) is not listed in 'properties'",
                    param,
                )
        elif key == "pattern":
            if not isinstance(value, str):
                raise _refuse(f"{param}: {where} must be a string (a regular expression)", param)
            check_regex(value, param, f"the JSON Schema 'pattern' (at {path})", in_json=True)
        elif key == "enum" and (not isinstance(value, list) or not value):
            raise _refuse(f"{param}: {where} must be a non-empty array", param)
