"""The ``response`` object (OpenAI "The response object"), with the echo of the request's parameters."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from proxy.protocol import Usage
from proxy.protocol.responses_request import ResponsesRequest

INCOMPLETE_REASONS = {"length": "max_output_tokens"}
"""Engine finish reasons that make a response ``incomplete``, and OpenAI's ``incomplete_details.reason``."""


def responses_usage(usage: Usage) -> dict[str, Any]:
    """Responses ``usage``: ``input_tokens`` (+ ``cached_tokens``, and ``cache_write_tokens`` 0:
    OpenAI's count of explicit, billed cache writes, required by its SDKs' types; the prefix cache
    here is automatic), ``output_tokens`` (+ ``reasoning_tokens``, 0 without a reasoning parser),
    ``total_tokens``."""
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens or 0},
            "total_tokens": usage.total_tokens}


TOOL_FIELDS = ("type", "name", "description", "parameters", "strict")
"""The fields of a function tool in the response's ``tools`` (openai-python ``FunctionTool``): each
present, null when the request left it out, so strict validators (Open Responses) accept it."""


def echo_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's function ``tools`` as the response shows them: :data:`TOOL_FIELDS`, in that
    order, a missing one null. ``strict`` is echoed as sent (null when absent, not OpenAI's default
    true): it changes nothing here; under ``tool_choice: "auto"`` the arguments are parsed from the
    model's text, and ``required`` or a named function constrains them by a grammar either way."""
    return [{k: tool.get(k) for k in TOOL_FIELDS} for tool in tools or [] if isinstance(tool, dict)]


def _number(body: dict[str, Any], name: str, default: float) -> Any:
    """A sampling parameter as used: the request's value, or the default when absent or null."""
    value = body.get(name)
    return default if value is None else value


@dataclass(frozen=True)
class ResponseHead:
    """What names one response: ``id`` (``resp_...``), ``created_at`` (Unix seconds), ``model``."""

    id: str
    created_at: int
    model: str


def response_object(head: ResponseHead, request: ResponsesRequest, *, status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                    finish_reason: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole ``response`` object.

    ``completed_at`` (Unix seconds) is now when ``status`` is ``completed`` and null otherwise, as
    OpenAI's ("only present when the status is completed"); ``safety_identifier`` and
    ``prompt_cache_key`` are echoed (the prefix cache here is automatic: the key changes nothing);
    ``presence_penalty`` / ``frequency_penalty`` as used (default 0), beside ``temperature`` / ``top_p``.

    Args:
        status: ``in_progress``, ``completed``, ``incomplete`` or ``failed``.
        output: the output items so far.
        usage: :func:`responses_usage`; None while in progress.
        finish_reason: the engine's, for ``incomplete_details`` (``length`` -> ``max_output_tokens``).
        error: ``{"code", "message"}`` of a failed response.
    """
    body = request.body
    text: dict[str, Any] = body["text"] if isinstance(body.get("text"), dict) else {}
    reasoning: dict[str, Any] = body["reasoning"] if isinstance(body.get("reasoning"), dict) else {}
    incomplete = INCOMPLETE_REASONS.get(finish_reason or "") if status == "incomplete" else None
    return {
        "id": head.id,
        "object": "response",
        "created_at": head.created_at,
        "completed_at": int(time.time()) if status == "completed" else None,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": None,
        "model": head.model,
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "service_tier": "default",
        "store": request.store,
        "temperature": _number(body, "temperature", 1.0),
        "text": {"format": text.get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": echo_tools(body.get("tools")),
        "top_logprobs": _number(body, "top_logprobs", 0),
        "top_p": _number(body, "top_p", 1.0),
        "presence_penalty": _number(body, "presence_penalty", 0.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0),
        "truncation": body.get("truncation") or "disabled",
        "usage": usage,
        "user": body.get("user"),
        "safety_identifier": body.get("safety_identifier"),
        "prompt_cache_key": body.get("prompt_cache_key"),
        "metadata": body.get("metadata") or {},
    }


def status_of(finish_reason: str | None) -> str:
    """``incomplete`` when the engine cut the output (``length``), else ``completed``."""
    return "incomplete" if finish_reason in INCOMPLETE_REASONS else "completed"
