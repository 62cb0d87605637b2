"""OpenAI request schemas, their validation, and the non-stream response bodies.

Requests are validated by hand (not pydantic) so that every error is an
:class:`~proxy.errors.InvalidRequestError` whose ``param`` names the offending field the way
OpenAI does (``messages[0].role``, ``temperature``, ...) and whose message is one readable
sentence, never a validation dump.

Field semantics and ranges follow the OpenAI API reference (Chat Completions and the legacy
Completions endpoint); the extras ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``min_tokens`` and ``stop_token_ids`` follow vLLM's OpenAI-compatible server.

Policies (documented in the README):

- Unknown keys are accepted and ignored (as OpenAI-compatible servers do), except the
  known-unsupported features listed in :data:`UNSUPPORTED_CHAT_FIELDS` /
  :data:`UNSUPPORTED_COMPLETION_FIELDS`, which get a 400 naming the field.
- ``stream_options`` with ``stream: false`` is a 400 (as vLLM does; OpenAI defines it for streaming
  only).
- Chat without ``max_tokens``/``max_completion_tokens``: the rest of the context
  (``max_model_len - prompt_tokens``, like vLLM). Completions without ``max_tokens``: 16 (OpenAI's
  documented default).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

from proxy.errors import ContextLengthExceededError, InvalidRequestError
from proxy.sampling import SamplingParams

CHAT_ROLES = ("system", "developer", "user", "assistant")
MAX_TOP_LOGPROBS = 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

# value -> None when the value is harmless (the feature is not used), else an error message.
UNSUPPORTED_CHAT_FIELDS = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "response_format",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "best_of",
)
UNSUPPORTED_COMPLETION_FIELDS = ("suffix", "echo", "best_of", "tools", "response_format")


# ----------------------------------------------------------------------------- body decoding


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a request body: strict UTF-8, then JSON, which must be an object.

    Raises:
        InvalidRequestError: not UTF-8, not JSON, or not a JSON object (HTTP 400).
    """
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


def _opt_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"'{name}' must be a boolean, not {_type_name(value)}.")
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
        include_usage = _opt_bool(options, "include_usage", False)
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
        top_p=_opt_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=0 if top_k in (None, -1) else top_k,
        min_p=_opt_number(body, "min_p", 0.0, 0.0, 1.0),
        seed=_opt_int(body, "seed", None, lo=-(2**63), hi=2**64 - 1),
        presence_penalty=_opt_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_opt_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_opt_number(body, "repetition_penalty", 1.0, 0.0, 2.0, lo_open=True),
        logit_bias=_logit_bias(body, vocab_size),
        stop=_stop(body),
        stop_token_ids=_stop_token_ids(body, vocab_size),
        ignore_eos=_opt_bool(body, "ignore_eos", False),
        min_tokens=min_tokens,
    )


# ----------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class ChatCompletionRequest:
    """A validated ``POST /v1/chat/completions`` body.

    Attributes:
        messages: ``({"role", "content"}, ...)`` with text content only (parts joined);
            ``developer`` is passed to the chat template as ``system``.
        max_tokens: ``max_completion_tokens`` or ``max_tokens``; None: the rest of the context.
        params: sampling parameters; ``max_tokens`` is a placeholder until
            :func:`resolve_max_tokens`.
    """

    model: str
    messages: tuple[dict[str, str], ...]
    n: int
    max_tokens: int | None
    stream: StreamOptions
    params: SamplingParams


@dataclass(frozen=True)
class CompletionRequest:
    """A validated ``POST /v1/completions`` body: ``prompt`` is text or token ids.

    Attributes:
        logprobs: the legacy ``logprobs`` integer (alternatives per position) or None.
    """

    model: str
    prompt: str | tuple[int, ...]
    n: int
    max_tokens: int
    logprobs: int | None
    stream: StreamOptions
    params: SamplingParams


def _content(value: Any, param: str, role: str) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        raise _bad(param, f"'{param}' is required for role '{role}'.")
    if not isinstance(value, list):
        raise _bad(param, f"'{param}' must be a string or an array of content parts, not {_type_name(value)}.")
    texts = []
    for j, part in enumerate(value):
        p = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _bad(p, f"'{p}' must be an object, not {_type_name(part)}.")
        kind = part.get("type")
        if kind != "text":
            if isinstance(kind, str):
                raise _bad(f"{p}.type", f"Content part type '{kind}' is not supported; only 'text' is.")
            raise _bad(f"{p}.type", f"'{p}.type' must be 'text'.")
        text = part.get("text")
        if not isinstance(text, str):
            raise _bad(f"{p}.text", f"'{p}.text' must be a string, not {_type_name(text)}.")
        texts.append(text)
    return "".join(texts)


def _messages(body: dict[str, Any]) -> tuple[dict[str, str], ...]:
    if "messages" not in body or body["messages"] is None:
        raise _bad("messages", "'messages' is required.")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise _bad("messages", f"'messages' must be an array, not {_type_name(messages)}.")
    if not messages:
        raise _bad("messages", "'messages' must contain at least one message.")
    out = []
    for i, message in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(p, f"'{p}' must be an object, not {_type_name(message)}.")
        role = message.get("role")
        if role is None:
            raise _bad(f"{p}.role", f"'{p}.role' is required.")
        if not isinstance(role, str):
            raise _bad(f"{p}.role", f"'{p}.role' must be a string, not {_type_name(role)}.")
        if role in ("tool", "function"):
            raise _bad(f"{p}.role", f"Role '{role}' is not supported by this server (no tool calling).")
        if role not in CHAT_ROLES:
            raise _bad(f"{p}.role", f"'{p}.role' must be one of {', '.join(CHAT_ROLES)}; got {role!r}.")
        for unsupported in ("tool_calls", "function_call", "audio"):
            if message.get(unsupported) not in (None, []):
                raise _bad(f"{p}.{unsupported}", f"'{p}.{unsupported}' is not supported by this server.")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise _bad(f"{p}.name", f"'{p}.name' must be a string, not {_type_name(name)}.")
        content = _content(message.get("content"), f"{p}.content", role)
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return tuple(out)


def parse_chat_request(body: dict[str, Any], *, max_n: int, vocab_size: int | None = None) -> ChatCompletionRequest:
    """Validate a chat completion body (OpenAI "Create chat completion").

    Args:
        body: the decoded JSON object.
        max_n: most choices per request (``n``).
        vocab_size: when given, token ids in ``logit_bias``/``stop_token_ids`` are range-checked.

    Raises:
        InvalidRequestError: with ``param`` naming the field.
    """
    model = _model(body)
    messages = _messages(body)
    _reject_unsupported(body, UNSUPPORTED_CHAT_FIELDS)
    n = _opt_int(body, "n", 1, lo=1, hi=max_n)
    assert n is not None
    max_tokens = _opt_int(body, "max_completion_tokens", None, lo=1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", None, lo=1)
    else:
        _opt_int(body, "max_tokens", None, lo=1)
    logprobs = _opt_bool(body, "logprobs", False)
    top_logprobs = _opt_int(body, "top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS) or 0
    if top_logprobs and not logprobs:
        raise _bad("top_logprobs", "'top_logprobs' requires 'logprobs' to be true.")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user", f"'user' must be a string, not {_type_name(user)}.")
    stream = _stream(body)
    params = replace(_sampling(body, vocab_size, max_tokens), logprobs=logprobs, top_logprobs=top_logprobs)
    return ChatCompletionRequest(model, messages, n, max_tokens, stream, params)


def _prompt(body: dict[str, Any], vocab_size: int | None) -> str | tuple[int, ...]:
    if body.get("prompt") is None:
        raise _bad("prompt", "'prompt' is required.")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise _bad("prompt", "Batched prompts (an array of several prompts) are not supported; "
                       "send one prompt per request.")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if prompt == "":
            raise _bad("prompt", "'prompt' must not be empty.")
        return prompt
    if not isinstance(prompt, list):
        raise _bad("prompt", f"'prompt' must be a string or an array of token ids, not {_type_name(prompt)}.")
    if not prompt:
        raise _bad("prompt", "'prompt' must not be empty.")
    for i, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, int):
            raise _bad("prompt", f"'prompt[{i}]' must be a token id (integer), not {_type_name(t)}.")
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise _bad("prompt", f"'prompt[{i}]' = {t} is not a token id of this model's vocabulary.")
    return tuple(prompt)


def parse_completion_request(body: dict[str, Any], *, max_n: int,
                             vocab_size: int | None = None) -> CompletionRequest:
    """Validate a legacy completion body (OpenAI "Create completion").

    ``prompt`` is a string, a token-id array, or a one-element array of either; several prompts
    in one request are a 400.

    Raises:
        InvalidRequestError: with ``param`` naming the field.
    """
    model = _model(body)
    prompt = _prompt(body, vocab_size)
    n = _opt_int(body, "n", 1, lo=1, hi=max_n)
    assert n is not None
    _reject_unsupported(body, UNSUPPORTED_COMPLETION_FIELDS)
    max_tokens = _opt_int(body, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS, lo=1)
    assert max_tokens is not None
    logprobs = _opt_int(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    stream = _stream(body)
    params = replace(_sampling(body, vocab_size, max_tokens), logprobs=logprobs is not None, top_logprobs=logprobs or 0)
    return CompletionRequest(model, prompt, n, max_tokens, logprobs, stream, params)


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int,
                       *, prompt_name: str = "messages") -> int:
    """The number of tokens to generate, checked against the context window.

    Args:
        requested: the client's ``max_tokens`` or None (then: ``max_model_len - num_prompt_tokens``,
            as vLLM does).
        num_prompt_tokens: tokens of the templated prompt.
        max_model_len: the context window in tokens.
        prompt_name: ``"messages"`` (chat) or ``"prompt"`` (completions), used in the message.

    Raises:
        ContextLengthExceededError: the prompt leaves no room, or prompt + requested exceeds the
            window; the message gives N, M, P and K like OpenAI's.
    """
    if num_prompt_tokens >= max_model_len:
        completion = requested if requested is not None else 1
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + completion} tokens ({num_prompt_tokens} in the {prompt_name}, "
            f"{completion} in the completion). Please reduce the length of the {prompt_name}.",
            param=prompt_name,
        )
    if requested is None:
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + requested > max_model_len:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the {prompt_name}, "
            f"{requested} in the completion). Please reduce the length of the {prompt_name} "
            "or the completion.",
            param="max_tokens",
        )
    return requested


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Parameters of choice ``index`` of an ``n > 1`` request: seeded requests use ``seed + index``."""
    if params.seed is None or index == 0:
        return params
    return replace(params, seed=params.seed + index)


# ----------------------------------------------------------------------------- responses


def usage_dict(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    """OpenAI ``usage``: ``prompt_tokens``, ``completion_tokens``, ``total_tokens``."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


def model_card(model_id: str, created: int, max_model_len: int | None = None) -> dict[str, Any]:
    """One entry of ``GET /v1/models`` (OpenAI "Model object", plus vLLM's ``max_model_len``)."""
    card: dict[str, Any] = {"id": model_id, "object": "model", "created": created, "owned_by": "streamproxy"}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    return card
