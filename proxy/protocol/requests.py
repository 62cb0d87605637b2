"""OpenAI request schemas (chat and legacy completions) and their validation.

Field semantics and ranges follow the OpenAI API reference (Chat Completions and the legacy
Completions endpoint); the extras ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``min_tokens``, ``stop_token_ids`` and ``thinking_token_budget`` (-1: no cap) follow vLLM's server.

Policies (documented in the README):

- Unknown keys are accepted and ignored (as OpenAI-compatible servers do), except the
  known-unsupported features listed in :data:`UNSUPPORTED_CHAT_FIELDS` /
  :data:`UNSUPPORTED_COMPLETION_FIELDS`, which get a 400 naming the field.
- ``stream_options`` with ``stream: false`` is a 400 (as vLLM does; OpenAI defines it for streaming
  only).
- Text content parts of one message are joined with a newline, as vLLM joins them (OpenAI does not
  document a separator; joining with nothing glued words of consecutive parts together).
- Chat without ``max_tokens``/``max_completion_tokens``: the rest of the context
  (``max_model_len - prompt_tokens``, like vLLM). Completions without ``max_tokens``: 16 (OpenAI's
  documented default).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from proxy.sampling import SamplingParams, StructuredOutputParams
from proxy.tools.request import ChatTools, parse_chat_tools, parse_structured_outputs

from .fields import (
    StreamOptions,
    _bad,
    _model,
    _opt_bool,
    _opt_int,
    _reject_unsupported,
    _sampling,
    _stream,
    _type_name,
)

# value -> None when the value is harmless (the feature is not used), else an error message.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")

UNSUPPORTED_CHAT_FIELDS = (
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "best_of",
)
UNSUPPORTED_COMPLETION_FIELDS = ("suffix", "echo", "best_of", "tools", "response_format", "guided_json",
                                 "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


# ----------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class ChatCompletionRequest:
    """A validated ``POST /v1/chat/completions`` body.

    Attributes:
        messages: ``({"role", "content"}, ...)`` with text content only (parts joined);
            ``developer`` is passed to the chat template as ``system``.
        max_tokens: ``max_completion_tokens`` or ``max_tokens``; None: the rest of the context.
        params: sampling parameters; ``max_tokens`` is a placeholder until
            :func:`~proxy.protocol.context.resolve_max_tokens`.
        raw_messages: the request's ``messages`` as sent (for ``tool_calls`` and ``tool_call_id``,
            see :func:`proxy.tools.request.template_messages`).
        tools: ``tools`` / ``tool_choice`` / ``parallel_tool_calls``; None: no tools.
        structured: the ``response_format`` / ``guided_*`` constraint; None: unconstrained.
        structured_param: the field that asked for ``structured`` (named in compile errors).
        template_kwargs: ``chat_template_kwargs`` (vLLM's extra), passed to the chat template.
        reasoning_effort: ``none`` / ``minimal`` / ``low`` / ``medium`` / ``high``; None: not given.
        thinking_token_budget: the most thinking tokens (``proxy.sampling.ThinkingBudget``); None: no cap.
    """

    model: str
    messages: tuple[dict[str, str], ...]
    n: int
    max_tokens: int | None
    stream: StreamOptions
    params: SamplingParams
    raw_messages: tuple[dict[str, Any], ...] = ()
    tools: ChatTools | None = None
    structured: StructuredOutputParams | None = None
    structured_param: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_effort: str | None = None
    thinking_token_budget: int | None = None


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
        raise _bad(
            param, f"'{param}' must be a string or an array of content parts, not {_type_name(value)}."
        )
    if not value and role != "assistant":  # as OpenAI (an assistant's may be empty beside its calls)
        raise _bad(param,
                   f"'{param}' must not be an empty array: send a string or at least one content part.")
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
    return "\n".join(texts)


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
        if role == "function":
            raise _bad(f"{p}.role", "Role 'function' is deprecated and not supported; use 'tool'.")
        if role not in CHAT_ROLES:
            raise _bad(f"{p}.role", f"'{p}.role' must be one of {', '.join(CHAT_ROLES)}; got {role!r}.")
        for unsupported in ("function_call", "audio"):
            if message.get(unsupported) not in (None, []):
                raise _bad(f"{p}.{unsupported}", f"'{p}.{unsupported}' is not supported by this server.")
        if message.get("tool_calls") not in (None, []) and role != "assistant":
            raise _bad(f"{p}.tool_calls", f"'{p}.tool_calls' is only allowed on assistant messages.")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise _bad(f"{p}.name", f"'{p}.name' must be a string, not {_type_name(name)}.")
        if role == "assistant" and message.get("content") is None and message.get("tool_calls"):
            content = ""  # the ordinary agent loop: a call without text (templates need a string)
        else:
            content = _content(message.get("content"), f"{p}.content", role)
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return tuple(out)


def parse_chat_request(
    body: dict[str, Any], *, max_n: int, vocab_size: int | None = None
) -> ChatCompletionRequest:
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
    tools = parse_chat_tools(body)
    structured, structured_param = parse_structured_outputs(body)
    if structured is not None and tools is not None and tools.is_constrained:
        raise _bad(structured_param or "response_format", f"'{structured_param}' cannot be combined with "
                   "tool_choice 'required' or a named function (both constrain the output).")
    return ChatCompletionRequest(
        model,
        messages,
        n,
        max_tokens,
        stream,
        params,
        tuple(body["messages"]),
        tools,
        structured,
        structured_param,
        *_reasoning_controls(body),
    )


def _reasoning_controls(body: dict[str, Any]) -> tuple[dict[str, Any], str | None, int | None]:
    """(``chat_template_kwargs``, ``reasoning_effort``, ``thinking_token_budget``) validated."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs",
                   f"'chat_template_kwargs' must be an object, not {_type_name(kwargs)}.")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise _bad("reasoning_effort", f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}; "
                   f"got {effort!r}.")
    budget = _opt_int(body, "thinking_token_budget", None, lo=-1)  # vLLM: -1 is no cap
    return dict(kwargs or {}), effort, None if budget == -1 else budget


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
    params = replace(
        _sampling(body, vocab_size, max_tokens), logprobs=logprobs is not None, top_logprobs=logprobs or 0
    )
    return CompletionRequest(model, prompt, n, max_tokens, logprobs, stream, params)


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Parameters of choice ``index`` of an ``n > 1`` request: seeded requests use ``seed + index``."""
    if params.seed is None or index == 0:
        return params
    return replace(params, seed=params.seed + index)
