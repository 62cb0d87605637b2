"""Decoding of request bodies and checks of single fields, each error naming its OpenAI ``param``.

Requests are validated by hand (not pydantic) so that every error is an
:class:`~proxy.errors.InvalidRequestError` whose ``param`` names the offending field the way
OpenAI does (``messages[0].role``, ``temperature``, ...) and whose message is one readable
sentence, never a validation dump.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from proxy.errors import InvalidRequestError
from proxy.sampling import SamplingParams

# ----------------------------------------------------------------------------- body decoding


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a request body: strict UTF-8, then JSON, which must be an object.

    A leading UTF-8 byte-order mark (EF BB BF, sent by some PowerShell, .NET and Java clients) is
    skipped, as RFC 8259 section 8.1 allows a parser to do.

    Raises:
        InvalidRequestError: not UTF-8, not JSON, or not a JSON object (HTTP 400).
    """
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(
            f"The request body is not valid UTF-8 (invalid byte at position {exc.start})."
        ) from None
    if not text.strip():
        raise InvalidRequestError("The request body is empty; expected a JSON object.")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(
            f"The request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})."
        ) from None
    except RecursionError:
        raise InvalidRequestError("The request body is nested too deeply.") from None
    if not isinstance(body, dict):
        raise InvalidRequestError(f"The request body must be a JSON object, not {_type_name(body)}.")
    bad = _surrogate_path(body, "")
    if bad is not None:
        raise InvalidRequestError(
            "The request contains a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair), "
            "which is not a Unicode character.",
            param=bad or None,
        )
    return body


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _surrogate_path(value: Any, path: str) -> str | None:
    """The path (``messages[0].content``) of the first string or key holding a lone surrogate, or None.

    JSON allows ``"\\ud800"`` escapes that decode to no Unicode scalar value; such text can be neither
    tokenized nor encoded as UTF-8 in a response, so it is refused up front (RFC 8259 section 8.2).
    """
    if isinstance(value, str):
        return path if _has_surrogate(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            sub = f"{path}.{key}" if path else str(key)
            if _has_surrogate(key):
                return path or sub.encode("utf-8", "backslashreplace").decode()
            found = _surrogate_path(item, sub)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _surrogate_path(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


# ----------------------------------------------------------------------------- field checks


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _bad(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def array_of_objects(value: Any, param: str) -> list[tuple[str, dict[str, Any]]]:
    """``value`` as ``(param[i], object)`` pairs (the path names the object's fields in errors).
    Raises InvalidRequestError naming ``param`` (not an array) or ``param[i]`` (not an object)."""
    if not isinstance(value, list):
        raise _bad(param, f"'{param}' must be an array, not {_type_name(value)}.")
    for i, entry in enumerate(value):
        if not isinstance(entry, dict):
            raise _bad(f"{param}[{i}]", f"'{param}[{i}]' must be an object, not {_type_name(entry)}.")
    return [(f"{param}[{i}]", entry) for i, entry in enumerate(value)]


def _opt_number(body: dict[str, Any], name: str, default: float, lo: float, hi: float,
                *, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, f"'{name}' must be a number, not {_type_name(value)}.")
    value = float(value)
    if math.isnan(value) or value > hi or value < lo or (lo_open and value <= lo):
        left = "(" if lo_open else "["
        raise _bad(name, f"'{name}' must be in {left}{lo:g}, {hi:g}], got {value:g}.")
    return value


def _opt_int(body: dict[str, Any], name: str, default: int | None, lo: int | None = None,
             hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"'{name}' must be an integer, not {_type_name(value)}.")
    if lo is not None and value < lo:
        raise _bad(name, f"'{name}' must be at least {lo}, got {value}.")
    if hi is not None and value > hi:
        raise _bad(name, f"'{name}' must be at most {hi}, got {value}.")
    return value


def _opt_bool(body: dict[str, Any], name: str, default: bool, *, path: str | None = None) -> bool:
    """``body[name]`` as a bool (``default`` when absent or null); ``path``: the field's full name
    in errors when ``body`` is a nested object (``stream_options.include_usage``)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        param = path or name
        raise _bad(param, f"'{param}' must be a boolean, not {_type_name(value)}.")
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise _bad("stop", f"'stop' must be a string or an array of strings, not {_type_name(value)}.")
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise _bad("stop", f"'stop[{i}]' must be a string, not {_type_name(item)}.")
        if item == "":
            raise _bad("stop", f"'stop[{i}]' must not be empty.")
    return tuple(dict.fromkeys(items))


def _logit_bias(body: dict[str, Any], vocab_size: int | None) -> dict[int, float]:
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad("logit_bias", f"'logit_bias' must be an object, not {_type_name(value)}.")
    bias: dict[int, float] = {}
    for key, b in value.items():
        try:
            token_id = int(key)
        except ValueError:
            raise _bad("logit_bias", f"'logit_bias' keys must be token ids, got {key!r}.") from None
        if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
            raise _bad("logit_bias", f"'logit_bias' token id {token_id} is outside the vocabulary.")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or math.isnan(b):
            raise _bad("logit_bias", f"'logit_bias[{key}]' must be a number, not {_type_name(b)}.")
        if not -100 <= b <= 100:
            raise _bad("logit_bias", f"'logit_bias[{key}]' must be in [-100, 100], got {b:g}.")
        bias[token_id] = float(b)
    return bias


def _stop_token_ids(body: dict[str, Any], vocab_size: int | None) -> tuple[int, ...]:
    value = body.get("stop_token_ids")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise _bad("stop_token_ids", "'stop_token_ids' must be an array of token ids.")
    if vocab_size is not None and any(v >= vocab_size for v in value):
        raise _bad("stop_token_ids", "'stop_token_ids' contains a token id outside the vocabulary.")
    return tuple(value)


def _reject_unsupported(body: dict[str, Any], fields: tuple[str, ...]) -> None:
    """400 for a known-unsupported feature that is actually used (never silently ignored)."""
    for name in fields:
        value = body.get(name)
        if value is None:
            continue
        if name in ("tools", "functions") and value == []:
            continue
        if name in ("tool_choice", "function_call") and value == "none":
            continue
        if name == "response_format" and isinstance(value, dict) and value.get("type") == "text":
            continue
        if name == "modalities" and value == ["text"]:
            continue
        if name == "echo" and value is False:
            continue
        if name == "best_of" and value == body.get("n", 1):
            continue
        raise _bad(name, f"'{name}' is not supported by this server.")


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise _bad("model", "'model' is required.")
    if not isinstance(model, str):
        raise _bad("model", f"'model' must be a string, not {_type_name(model)}.")
    return model


@dataclass(frozen=True)
class StreamOptions:
    """Parsed request flags that shape the response rather than the sampling."""

    stream: bool
    include_usage: bool


def _stream(body: dict[str, Any]) -> StreamOptions:
    stream = _opt_bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise _bad("stream_options", "'stream_options' is only allowed when 'stream' is true.")
        if not isinstance(options, dict):
            raise _bad("stream_options", f"'stream_options' must be an object, not {_type_name(options)}.")
        include_usage = _opt_bool(options, "include_usage", False, path="stream_options.include_usage")
    return StreamOptions(stream=stream, include_usage=include_usage)


def _sampling(body: dict[str, Any], vocab_size: int | None, max_tokens: int | None) -> SamplingParams:
    """The sampling fields shared by both endpoints; ``max_tokens`` is filled in later.

    ``max_tokens`` (the client's, or None) bounds ``min_tokens``, as vLLM checks it.
    """
    top_k = _opt_int(body, "top_k", 0, lo=-1)
    min_tokens = _opt_int(body, "min_tokens", 0, lo=0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise _bad("min_tokens", f"'min_tokens' ({min_tokens}) must not exceed 'max_tokens' ({max_tokens}).")
    return SamplingParams(
        max_tokens=1,
        temperature=_opt_number(body, "temperature", 1.0, 0.0, 2.0),
        # OpenAI documents top_p in [0, 1]; 0 keeps only the most likely token (greedy, issue 12).
        top_p=_opt_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=0 if top_k in (None, -1) else top_k,
        min_p=_opt_number(body, "min_p", 0.0, 0.0, 1.0),
        # A signed 64-bit integer, as vLLM bounds it (torch.long); each value has its own stream.
        seed=_opt_int(body, "seed", None, lo=-(2**63), hi=2**63 - 1),
        presence_penalty=_opt_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_opt_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_opt_number(body, "repetition_penalty", 1.0, 0.0, 2.0, lo_open=True),
        logit_bias=_logit_bias(body, vocab_size),
        stop=_stop(body),
        stop_token_ids=_stop_token_ids(body, vocab_size),
        ignore_eos=_opt_bool(body, "ignore_eos", False),
        min_tokens=min_tokens,
    )


