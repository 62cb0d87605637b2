"""The ``response`` object (OpenAI "The response object"), with the echo of the request's parameters."""

from __future__ import annotations

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
        "temperature": body.get("temperature", 1.0),
        "text": {"format": text.get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_logprobs": body.get("top_logprobs", 0),
        "top_p": body.get("top_p", 1.0),
        "truncation": body.get("truncation") or "disabled",
        "usage": usage,
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }


def status_of(finish_reason: str | None) -> str:
    """``incomplete`` when the engine cut the output (``length``), else ``completed``."""
    return "incomplete" if finish_reason in INCOMPLETE_REASONS else "completed"
