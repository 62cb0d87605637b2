"""How an invalid tool or structured-output field is refused: a 400 naming the field's ``param``.

The message names the JSON kind of the value that was sent (``object``, ``array``, ``string``, ...).
"""

from __future__ import annotations

from typing import Any

from proxy.errors import InvalidRequestError

__all__ = ["bad_field", "json_kind"]


def bad_field(param: str, message: str) -> InvalidRequestError:
    """The :class:`~proxy.errors.InvalidRequestError` (400) for field ``param`` (to raise)."""
    return InvalidRequestError(message, param=param)


def json_kind(value: Any) -> str:
    """The JSON kind of a decoded value (``object``, ``array``, ``string``, ``boolean``, ``null``,
    ``number``), or its Python type name for anything else."""
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number" if isinstance(value, (int, float)) else type(value).__name__
    )
