"""What a thinking model needs from the request pipeline: the reasoning controls passed to the chat
template (``chat_template_kwargs``, ``reasoning_effort``, past turns' thinking) and the grammar of a
constrained request gated to start after the thinking (``StructuredOutputParams.reasoning_end_ids``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from proxy.errors import InvalidRequestError
from proxy.protocol import ChatCompletionRequest
from proxy.reasoning import get_reasoning_format
from proxy.sampling import StructuredOutputParams
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
