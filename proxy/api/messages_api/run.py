"""One Messages request after preparation: generate its one choice, then answer with the ``message``
object (non-stream) or its event stream (``stream: true``).

The same rules as chat completions (``proxy.api.completion``) and the Responses API: one
``try/finally`` closes the generation however the request ends; a stream first waits for its first
output (up to the headers timeout) so that an early failure is still a JSON error with its status;
529 / 503 before any byte. Stream events (Anthropic "Streaming Messages"): ``message_start`` (the
message with empty ``content``), ``ping``, the blocks' events (:mod:`~proxy.api.messages_api.output`),
``message_delta`` (``stop_reason``, ``stop_sequence`` and the final ``usage``), ``message_stop``. An
engine error mid-stream is an ``error`` event, and the stream ends. ``ping`` events while nothing
comes for the keep-alive interval.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from proxy.engine.client import ChoiceDelta, EngineClient, Generation
from proxy.errors import StreamproxyError
from proxy.pipeline import ChoiceParts, PreparedRequest
from proxy.protocol.messages_request import MessagesRequest
from proxy.settings import Settings

from ..completion import serve_generation
from ..streaming import KEEPALIVE, paced
from .body import MessageHead, matched_stop, message_object, messages_usage, stop_reason
from .errors import anthropic_error
from .output import PING, MessageOutput, sse_event


class MessageRun:
    """The state of one message while it is generated.

    Args:
        client: the engine client (its tokenizer decodes the output to find a stop sequence).
        request: the validated Messages request.
        prepared: its prepared form (prompt ids, params with ``max_tokens`` lowered, tools).
        context_management: the response's ``context_management`` (``applied_edits``), on the message
            and on the stream's ``message_delta``; None: not sent (the request had no edits).
    """

    def __init__(self, client: EngineClient, request: MessagesRequest, prepared: PreparedRequest,
                 context_management: dict[str, Any] | None = None) -> None:
        self.head = MessageHead(f"msg_{uuid.uuid4().hex}", client.model.served_model_name, context_management)
        self.client, self.request, self.prepared = client, request, prepared
        self.choice = prepared.choice_output()
        self._text: list[str] = []
        self._token_ids: list[int] = []

    def _feed(self, output: MessageOutput, deltas: Sequence[ChoiceDelta]) -> tuple[list[bytes], str | None]:
        """Feed one batch of deltas -> (events, the engine's finish reason when the choice ended)."""
        out: list[bytes] = []
        finish = None
        for d in deltas:
            self._text.append(d.text)
            self._token_ids += d.token_ids
            parts = self.choice.feed(d.text)
            if d.finish_reason is not None:
                last, _ = self.choice.finish(d.finish_reason)
                finish = d.finish_reason
                parts = ChoiceParts(parts.reasoning + last.reasoning, parts.content + last.content,
                                    parts.calls + last.calls)
            out += output.feed(parts)
        return out, finish

    def _ending(self, output: MessageOutput, finish: str | None) -> tuple[str, str | None]:
        """(``stop_reason``, ``stop_sequence``) of the finished output."""
        seq = None
        stops = self.request.stop_sequences
        if finish == "stop" and stops:
            decoded = self.client.tokenizer.decode(self._token_ids)
            seq = matched_stop(decoded, len("".join(self._text)), stops)
        return stop_reason(finish, output.has_tool_use, seq), seq

    async def _whole(self, generation: Generation) -> dict[str, object]:
        output = MessageOutput(stream=False, omit_thinking=self.request.omit_thinking)
        finish = None
        async for deltas in generation:
            finish = self._feed(output, deltas)[1] or finish
        output.close()
        reason, seq = self._ending(output, finish)
        return message_object(self.head, output.content, messages_usage(generation.usage), reason, seq)

    async def respond(self, request: Request, settings: Settings) -> Response:
        """Generate and answer (JSON body or event stream).

        Raises (before any byte is sent): as :func:`proxy.api.completion.respond`.
        """
        prepared = self.prepared
        generation = self.client.generate(prepared.prompt_ids, prepared.params, 1, request_id=self.head.id)
        keepalive_s = settings.keepalive_interval_s or None
        return await serve_generation(request, generation, settings, prepared.stream.stream,
                                      lambda: self._whole(generation),
                                      lambda first: self._events(generation, first, keepalive_s))

    async def _events(self, generation: Generation, first: Sequence[ChoiceDelta] | None,
                      keepalive_s: float | None) -> AsyncIterator[bytes]:
        output = MessageOutput(stream=True, omit_thinking=self.request.omit_thinking)
        try:
            start = message_object(self.head, [], {**messages_usage(generation.usage), "output_tokens": 0})
            out = [sse_event("message_start", {"message": start}), PING]
            finish = None
            if first:
                events, finish = self._feed(output, first)
                out += events
            try:
                async for item in paced(generation, keepalive_s, out):
                    if isinstance(item, bytes):
                        yield PING if item == KEEPALIVE else item
                    else:
                        events, ended = self._feed(output, item)
                        out += events
                        finish = ended or finish
            except StreamproxyError as exc:
                out += output.close()
                out.append(sse_event("error", {"error": anthropic_error(exc)["error"]}))
                yield b"".join(out)
                return
            out += output.close()
            reason, seq = self._ending(output, finish)
            delta = {"delta": {"stop_reason": reason, "stop_sequence": seq},
                     "usage": messages_usage(generation.usage)}
            if self.head.context_management is not None:
                delta["context_management"] = self.head.context_management
            out.append(sse_event("message_delta", delta))
            out.append(sse_event("message_stop", {}))
            yield b"".join(out)
        finally:
            await generation.aclose()
