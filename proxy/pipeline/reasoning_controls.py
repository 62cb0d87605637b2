"""What a thinking model needs from the request pipeline: the reasoning controls passed to the chat
template (``chat_template_kwargs``, ``reasoning_effort``, past turns' thinking) and the grammar of a
constrained request gated to start after the thinking (``StructuredOutputParams.reasoning_end_ids``),
and the thinking budget (``thinking_token_budget``: ``SamplingParams.thinking_budget``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from proxy.errors import InvalidRequestError
from proxy.protocol import ChatCompletionRequest
from proxy.reasoning import get_reasoning_format
from proxy.sampling import StructuredOutputParams, ThinkingBudget
from proxy.tokenizer import Tokenizer

from .features import ModelFeatures


def with_past_reasoning(messages: list[dict[str, Any]], raw: tuple[dict[str, Any], ...]) -> None:
    """Assistant turns of the history that carry their thinking (``reasoning_content`` or
    ``reasoning``) pass it to the template under the names templates read (``reasoning_content``:
    Qwen3; ``thinking``: GPT-OSS); the template decides what to keep (most drop past thinking).

    Raises:
        InvalidRequestError: the thinking is not a string.
    """
    for i, (msg, src) in enumerate(zip(messages, raw)):
        for key in ("reasoning_content", "reasoning"):
            value = src.get(key)
            if value is None:
                continue
            if not isinstance(value, str):
                raise InvalidRequestError(f"'messages[{i}].{key}' must be a string.",
                                          param=f"messages[{i}].{key}")
            if msg["role"] == "assistant" and value:
                msg["reasoning_content"] = msg["thinking"] = value
            break


def template_kwargs(chat: ChatCompletionRequest, features: ModelFeatures) -> dict[str, Any]:
    """``chat_template_kwargs``, with ``reasoning_effort`` mapped to what templates read: GPT-OSS's
    ``reasoning_effort`` (``low`` / ``medium`` / ``high``; ``none`` and ``minimal`` are ``low``), and
    ``enable_thinking: false`` for ``none`` on a template with that switch (Qwen3). Elsewhere the
    effort has no effect (templates ignore unknown variables)."""
    kwargs = dict(chat.template_kwargs)
    effort = chat.reasoning_effort
    if effort is None:
        return kwargs
    kwargs.setdefault("reasoning_effort", {"none": "low", "minimal": "low"}.get(effort, effort)
                      if features.reasoning_parser == "gpt_oss" else effort)
    if effort == "none" and features.template_thinks:
        kwargs.setdefault("enable_thinking", False)
    return kwargs


HARMONY_FINAL = "<|channel|>final<|message|>"
"""Where a harmony (GPT-OSS) answer starts: the grammar of a constrained request applies after it."""


def after_reasoning(so: StructuredOutputParams, tokenizer: Tokenizer, reasoning: str | None,
                     prompt_text: str) -> StructuredOutputParams:
    """The grammar of ``so`` gated to start after the thinking (the thinking itself is free text):
    a prompt that opened the thinking waits for the close marker; one that closed it (thinking
    turned off) applies the grammar at once; otherwise the output thinks only if its first token
    opens the thinking (``reasoning_start_ids``). Harmony's answer starts after its ``final``
    channel header. Marker ids are the tokenizer's encoding of the marker text."""
    if reasoning is None:
        return so
    fmt = get_reasoning_format(reasoning)
    close = fmt.close_marker or HARMONY_FINAL
    tail = prompt_text.rstrip()
    if fmt.close_marker and tail.endswith(fmt.close_marker):
        return so
    end_ids = tuple(tokenizer.encode(close, add_special_tokens=False))
    if not end_ids:
        return so
    if not fmt.close_marker or fmt.starts_in_reasoning(tail):
        return replace(so, reasoning_end_ids=end_ids, starts_in_reasoning=True)
    start_ids = tuple(tokenizer.encode(fmt.open_marker, add_special_tokens=False))
    return replace(so, reasoning_end_ids=end_ids, starts_in_reasoning=False, reasoning_start_ids=start_ids)


def thinking_budget(max_tokens: int, tokenizer: Tokenizer, reasoning: str | None,
                    starts_inside: bool) -> ThinkingBudget:
    """The :class:`ThinkingBudget` of a request's ``thinking_token_budget``: the reasoning format's
    close marker as token ids (the tokenizer's encoding of its text, as :func:`after_reasoning`), the
    open marker's where the prompt did not open the thinking (``starts_inside``).

    Raises:
        InvalidRequestError: the model has no reasoning parser (no thinking to close), or its format
            has no close marker to force (harmony: its answer is a new message, not a tag), naming
            ``thinking_token_budget``.
    """
    fmt = get_reasoning_format(reasoning) if reasoning is not None else None
    if fmt is None or not fmt.close_marker:
        why = ("this model has no reasoning parser (no thinking to close)" if fmt is None else
               f"the {fmt.name} reasoning format has no end-of-thinking marker to force")
        raise InvalidRequestError(f"'thinking_token_budget' cannot be enforced: {why}.",
                                  param="thinking_token_budget")
    end_ids = tuple(tokenizer.encode(fmt.close_marker, add_special_tokens=False))
    start_ids = () if starts_inside else tuple(tokenizer.encode(fmt.open_marker, add_special_tokens=False))
    return ThinkingBudget(max_tokens, end_ids, starts_inside, start_ids)
