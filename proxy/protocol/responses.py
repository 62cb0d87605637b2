"""OpenAI response bodies: logprobs, usage, model cards, and the two completion formats.

Everything the server writes in OpenAI's wire format is built here, beside the request schemas:
the non-stream bodies, the ``logprobs`` objects of chat (``logprobs.content``) and of legacy
completions (``tokens``/``token_logprobs``/``top_logprobs``/``text_offset``), ``usage``, and the
``ChunkFramer`` of a stream. :data:`CHAT` and :data:`COMPLETION` are the two formats; the API
picks one per endpoint and passes it down instead of an ``is_chat`` flag.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from proxy import hotpath

LOGPROB_FLOOR = -9999.0
"""-inf is not JSON; like vLLM, log-probabilities are clamped to this floor."""


@dataclass(frozen=True)
class LogprobEntry:
    """Log-probability of one generated token and its most likely alternatives.

    Attributes:
        token_id: the sampled token.
        token: the token's text (``Tokenizer.token_text``); may be a partial character.
        token_bytes: the exact bytes the token contributes to the output text (empty for an EOS
            or stop token, whose text is not part of the output).
        logprob: natural log-probability, clamped to :data:`LOGPROB_FLOOR`.
        top: ``(token, logprob, bytes)`` of the alternatives, most likely first.
    """

    token_id: int
    token: str
    token_bytes: bytes
    logprob: float
    top: tuple[tuple[str, float, bytes], ...]

    def to_chat(self) -> dict[str, Any]:
        """One entry of chat ``logprobs.content`` (OpenAI ``ChatCompletionTokenLogprob``)."""
        return {
            "token": self.token,
            "logprob": self.logprob,
            "bytes": list(self.token_bytes),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(b)} for t, lp, b in self.top],
        }


@dataclass(frozen=True)
class Usage:
    """OpenAI ``usage`` of one response, in tokens (all choices' completion tokens summed).

    ``cached_tokens``: prompt tokens whose K/V came from the prefix cache (OpenAI's
    ``usage.prompt_tokens_details.cached_tokens``), whole KV blocks and never the last prompt token;
    0 when none. As OpenAI does, the details object is always present. ``reasoning_tokens``: of the
    completion tokens, those generated inside the thinking (``completion_tokens_details``, present
    when the request had a reasoning parser; None: it had none).
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int | None = None

    @property
    def total_tokens(self) -> int:
        """``prompt_tokens + completion_tokens``."""
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        """``{"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details":
        {"cached_tokens"}}`` (key order of the OpenAI API reference), and
        ``completion_tokens_details: {"reasoning_tokens"}`` when counted."""
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                 "total_tokens": self.total_tokens,
                 "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        if self.reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return usage


def chat_logprobs(entries: Sequence[LogprobEntry]) -> dict[str, Any]:
    """Chat ``logprobs`` object: ``{"content": [entry, ...]}``."""
    return {"content": [e.to_chat() for e in entries]}


def _legacy_top(entry: LogprobEntry) -> dict[str, float]:
    """The alternatives plus the sampled token: OpenAI "Create completion" says the sampled token's
    logprob is always returned, "so there may be up to logprobs+1 elements" (vLLM does the same)."""
    top = {t: lp for t, lp, _ in entry.top}
    top.setdefault(entry.token, entry.logprob)
    return top


def completion_logprobs(entries: Sequence[LogprobEntry], text_offset: int) -> dict[str, Any]:
    """Legacy completions ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``.

    ``text_offset[i]`` is the character offset of token ``i`` in the choice's text, counted from
    ``text_offset`` (the characters of earlier chunks), summing ``len(token)`` like vLLM does.
    """
    offsets = []
    pos = text_offset
    for e in entries:
        offsets.append(pos)
        pos += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [_legacy_top(e) for e in entries],
        "text_offset": offsets,
    }


def model_card(model_id: str, created: int, max_model_len: int | None = None, *, dtype: str | None = None,
               quantization: str | None = None) -> dict[str, Any]:
    """One entry of ``GET /v1/models`` (OpenAI "Model object", plus vLLM's ``max_model_len``, and our
    ``dtype`` and ``quantization``: what is served, when known)."""
    card: dict[str, Any] = {"id": model_id, "object": "model", "created": created, "owned_by": "streamproxy"}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    if dtype is not None:
        card["dtype"] = dtype
    if quantization is not None:
        card["quantization"] = quantization
    return card


@dataclass(frozen=True)
class ChoiceResult:
    """One finished choice of a non-stream response."""

    index: int
    text: str
    logprobs: Sequence[LogprobEntry] | None  # None: logprobs were not requested
    finish_reason: str | None


@dataclass(frozen=True)
class CompletionFormat:
    """The wire format of one endpoint: chat (``chat.completion``) or legacy (``text_completion``).

    Attributes:
        object: ``object`` of a non-stream body.
        chunk_object: ``object`` of a stream chunk.
        id_prefix: prefix of the response id (``chatcmpl``, ``cmpl``), as OpenAI's.
        is_chat: chat sends a role chunk first and wraps text in ``message``/``delta``.
    """

    object: str
    chunk_object: str
    id_prefix: str
    is_chat: bool

    def logprobs(self, entries: Sequence[LogprobEntry], text_offset: int) -> dict[str, Any]:
        """The ``logprobs`` object of one chunk or choice; ``text_offset``: characters before it."""
        return chat_logprobs(entries) if self.is_chat else completion_logprobs(entries, text_offset)

    def framer(self, response_id: str, created: int, model: str, include_usage: bool) -> hotpath.ChunkFramer:
        """The hot path's ``ChunkFramer`` for this format's stream chunks (SSE bytes)."""
        return hotpath.ChunkFramer(self.chunk_object, response_id, created, model, include_usage)

    def choice(self, result: ChoiceResult) -> dict[str, Any]:
        """One entry of ``choices`` of a non-stream body."""
        lp = None if result.logprobs is None else self.logprobs(result.logprobs, 0)
        if self.is_chat:
            return {"index": result.index, "message": {"role": "assistant", "content": result.text},
                    "logprobs": lp, "finish_reason": result.finish_reason}
        return {"index": result.index, "text": result.text, "logprobs": lp,
                "finish_reason": result.finish_reason}

    def body(self, response_id: str, created: int, model: str, results: Sequence[ChoiceResult],
             usage: Usage) -> dict[str, Any]:
        """The whole non-stream response body."""
        return {"id": response_id, "object": self.object, "created": created, "model": model,
                "choices": [self.choice(r) for r in results], "usage": usage.to_dict()}


CHAT = CompletionFormat("chat.completion", "chat.completion.chunk", "chatcmpl", is_chat=True)
COMPLETION = CompletionFormat("text_completion", "text_completion", "cmpl", is_chat=False)
