"""``POST /v1/embeddings``: the request schema and the response body (OpenAI "Create embeddings").

Request (OpenAI API reference, "Embeddings"): ``input`` is a string, an array of strings, an array of
token ids, or an array of token-id arrays (at most :data:`MAX_INPUTS` items, none empty); ``model``;
``encoding_format`` ``"float"`` (default) or ``"base64"`` (the little-endian float32 bytes of each
vector, what the OpenAI Python SDK and LangChain ask for by default); ``dimensions`` (a positive
width; the upper bound is the model's, checked where the model is known); ``user`` (accepted, a
string). vLLM's extra ``truncate_prompt_tokens``: keep at most this many tokens of each input
(``-1``: the model's length) instead of refusing a longer one.

Response: ``{"object": "list", "data": [{"object": "embedding", "index": i, "embedding": ...}],
"model", "usage": {"prompt_tokens", "total_tokens"}}``. Every error is an
:class:`~proxy.errors.InvalidRequestError` whose ``param`` names the field (``input[3]`` for one
item), never a 5xx.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from proxy.errors import InvalidRequestError

from .fields import _model, _opt_int, _type_name

MAX_INPUTS = 2048
"""Most items in one ``input`` array (OpenAI's documented limit)."""

ENCODING_FORMATS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingRequest:
    """A validated embeddings body.

    Attributes:
        model: the id the client sent.
        texts: the inputs as strings, or None when they are token ids.
        token_ids: the inputs as token-id tuples, or None when they are strings.
        encoding_format: ``"float"`` or ``"base64"``.
        dimensions: requested output width (>= 1), or None for the model's own.
        truncate_prompt_tokens: keep at most this many tokens of each input; ``-1``: the model's
            length; None: refuse an input longer than the model's length.
        user: the client's end-user id (accepted, not used).
    """

    model: str
    texts: tuple[str, ...] | None
    token_ids: tuple[tuple[int, ...], ...] | None
    encoding_format: str = "float"
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    user: str | None = None

    @property
    def num_inputs(self) -> int:
        return len(self.texts if self.texts is not None else self.token_ids or ())


def _bad(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ids(value: list[Any], param: str) -> tuple[int, ...]:
    if not value:
        raise _bad(param, f"'{param}' must not be an empty array of token ids.")
    for j, t in enumerate(value):
        if not _is_id(t) or t < 0:
            got = f"the negative integer {t}" if _is_id(t) else _type_name(t)
            raise _bad(param, f"'{param}[{j}]' must be a token id (a non-negative integer), not {got}.")
    return tuple(value)


def _inputs(body: dict[str, Any]) -> tuple[tuple[str, ...] | None, tuple[tuple[int, ...], ...] | None]:
    """(texts, token ids): exactly one is not None."""
    value = body.get("input")
    if value is None:
        raise _bad("input", "'input' is required.")
    if isinstance(value, str):
        if value == "":
            raise _bad("input", "'input' must not be an empty string.")
        return (value,), None
    if not isinstance(value, list):
        raise _bad("input", "'input' must be a string, an array of strings, an array of token ids or an "
                   f"array of token-id arrays, not {_type_name(value)}.")
    if not value:
        raise _bad("input", "'input' must not be an empty array.")
    if len(value) > MAX_INPUTS:
        raise _bad("input", f"'input' has {len(value)} items; at most {MAX_INPUTS} are accepted in one "
                   "request.")
    first = value[0]
    if _is_id(first):
        return None, (_ids(value, "input"),)
    kind = str if isinstance(first, str) else list if isinstance(first, list) else None
    if kind is None:
        raise _bad("input[0]", f"'input[0]' must be a string or an array of token ids, not "
                   f"{_type_name(first)}.")
    for i, item in enumerate(value):
        if not isinstance(item, kind):
            want = "a string" if kind is str else "an array of token ids"
            raise _bad(f"input[{i}]", f"'input[{i}]' must be {want} like 'input[0]' (an array may not mix "
                       f"strings and token ids), not {_type_name(item)}.")
        if kind is str and item == "":
            raise _bad(f"input[{i}]", f"'input[{i}]' must not be an empty string.")
    if kind is str:
        return tuple(value), None
    return None, tuple(_ids(item, f"input[{i}]") for i, item in enumerate(value))


def parse_embedding_request(body: dict[str, Any]) -> EmbeddingRequest:
    """Validate an embeddings body (the rules: this module's docstring).

    Raises:
        InvalidRequestError: the first bad field, with ``param`` naming it (``input``, ``input[i]``,
            ``model``, ``encoding_format``, ``dimensions``, ``truncate_prompt_tokens``, ``user``).
    """
    model = _model(body)
    texts, token_ids = _inputs(body)
    encoding = body.get("encoding_format")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODING_FORMATS:
        shown = repr(encoding) if isinstance(encoding, str) else _type_name(encoding)
        raise _bad("encoding_format", f"'encoding_format' must be 'float' or 'base64', not {shown}.")
    dimensions = _opt_int(body, "dimensions", None, lo=1)
    truncate = _opt_int(body, "truncate_prompt_tokens", None, lo=-1)
    if truncate == 0:
        raise _bad("truncate_prompt_tokens", "'truncate_prompt_tokens' must be -1 (the model's length) or at "
                   "least 1, got 0.")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user", f"'user' must be a string, not {_type_name(user)}.")
    return EmbeddingRequest(model, texts, token_ids, encoding, dimensions, truncate, user)


def encode_embedding(vector: np.ndarray, encoding_format: str) -> np.ndarray | str:
    """One vector on the wire: float32 values (a JSON array once :func:`embedding_response` writes
    them), or base64 of its little-endian float32 bytes (what the OpenAI SDK decodes with
    ``np.frombuffer(base64.b64decode(s), dtype="float32")``).

    Args:
        vector: ``[dim]``, any float dtype (sent as float32).
        encoding_format: ``"float"`` or ``"base64"``.

    Returns:
        ``[dim]`` C-contiguous little-endian float32 for ``"float"``; the ASCII base64 text otherwise.
    """
    as_f32 = np.ascontiguousarray(vector, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(as_f32.tobytes()).decode("ascii")
    return as_f32


def embedding_response(vectors: np.ndarray, model: str, num_prompt_tokens: int,
                       encoding_format: str) -> bytes:
    """The response body, compact UTF-8 JSON: one ``data`` entry a row of ``vectors``
    (``[num_inputs, dim]``), in input order; ``usage`` counts the tokens embedded (after truncation),
    ``total_tokens == prompt_tokens``.

    A ``"float"`` vector is written by orjson straight from the float32 array, each value the
    shortest decimal that reads back as the same float32 (a non-finite value as ``null``), fast
    enough to run on the event loop (why not ``json``: docs/embeddings.md).
    """
    data = [{"object": "embedding", "index": i, "embedding": encode_embedding(v, encoding_format)}
            for i, v in enumerate(vectors)]
    payload = {"object": "list", "data": data, "model": model,
               "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens}}
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)
