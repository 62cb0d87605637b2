"""One Responses API request after preparation: generate its one choice, then answer with the
``response`` object (non-stream) or its event stream (``stream: true``).

The same rules as chat completions (``proxy.api.completion``): one ``try/finally`` closes the
generation however the request ends; a stream first waits for its first output (up to the
headers timeout) so that an early failure is still a JSON error with its status; 429 / 503 before
any byte. Stream events: ``response.created``, ``response.in_progress``, the items' events
(``proxy.api.responses_api.output``), then exactly one of ``response.completed`` /
``response.incomplete`` carrying the full response; an engine error mid-stream is an ``error``
event followed by ``response.failed``. Keep-alive comments (``: keepalive``) while nothing comes.
Responses streams end without ``[DONE]``, as OpenAI's do.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from proxy.engine.client import ChoiceDelta, EngineClient, Generation
from proxy.errors import StreamproxyError
from proxy.hotpath import EventFramer, dumps
from proxy.pipeline import PreparedRequest
from proxy.protocol.responses_request import ResponsesRequest
from proxy.settings import Settings

from ..completion import collect, serve_generation
from ..streaming import KEEPALIVE, paced
from .body import ResponseHead, response_object, responses_usage, status_of
from .output import ResponseOutput
from .store import ResponseStore


class ResponseRun:
    """The state of one response while it is generated.

    Args:
        client: the engine client.
        request: the validated Responses request.
        prepared: its prepared form (prompt ids, params, tools).
        store: where a finished response is kept when ``request.store``.
    """

    def __init__(self, client: EngineClient, request: ResponsesRequest, prepared: PreparedRequest,
                 store: ResponseStore) -> None:
        self.head = ResponseHead(f"resp_{uuid.uuid4().hex}", int(time.time()), client.model.served_model_name)
        self.client, self.request, self.prepared, self.store = client, request, prepared, store
        self.choice = prepared.choice_output()
        self._stored: str | None = None  # the status this run last stored

    def _object(self, output: ResponseOutput, status: str, generation: Generation | None = None,
                finish_reason: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        usage = None if generation is None or status == "in_progress" else responses_usage(generation.usage)
        return response_object(self.head, self.request, status=status,
                               output=list(output.items), usage=usage, finish_reason=finish_reason,
                               error=error)

    def _finished(self, output: ResponseOutput, generation: Generation,
                  finish_reason: str | None) -> dict[str, Any]:
        obj = self._object(output, status_of(finish_reason), generation, finish_reason)
        self._store(obj, output.items)
        return obj

    def _store(self, obj: dict[str, Any], output_items: list[dict[str, Any]]) -> None:
        """Keep ``obj`` (with its input and output items) when the request asked to store it: first
        ``in_progress`` while it is generated (``GET /v1/responses/{id}`` shows it, as OpenAI's),
        then its final form (completed, incomplete or failed)."""
        if self.request.store and self.store.put(obj, self.request.items + output_items):
            self._stored = obj["status"]

    def _drop_unfinished(self) -> None:
        """The request ended without a final response (the client went away, or an error answered
        before any byte): it is not kept (an ``in_progress`` entry would never end)."""
        if self._stored == "in_progress":
            self.store.delete(self.head.id)
            self._stored = None

    async def respond(self, request: Request, settings: Settings) -> Response:
        """Generate and answer (JSON body or event stream).

        Raises (before any byte is sent): as :func:`proxy.api.completion.respond`.
        """
        prepared = self.prepared
        generation = self.client.generate(prepared.prompt_ids, prepared.params, 1, request_id=self.head.id,
                                          images=prepared.images)
        try:
            self._store(self._object(ResponseOutput(None, False), "in_progress"), [])
        except BaseException:
            await generation.aclose()
            raise

        async def whole() -> dict[str, Any]:
            (result,) = await collect(generation, prepared.params.logprobs)
            output = ResponseOutput(None, self.request.include_logprobs)
            output.feed(self.choice.feed(result.text), list(result.logprobs or ()))
            last, finish = self.choice.finish(result.finish_reason)
            output.feed(last)
            output.close(finish)
            return self._finished(output, generation, finish)

        keepalive_s = settings.keepalive_interval_s or None
        return await serve_generation(request, generation, settings, prepared.stream.stream, whole,
                                      lambda first: self._events(generation, first, keepalive_s),
                                      unanswered=self._drop_unfinished)

    def _frame(self, deltas: Sequence[ChoiceDelta], output: ResponseOutput, out: list[bytes]) -> str | None:
        finish = None
        for d in deltas:
            out += output.feed(self.choice.feed(d.text), d.logprobs)
            if d.finish_reason is not None:
                last, finish = self.choice.finish(d.finish_reason)
                out += output.feed(last)
                out += output.close(finish)
        return finish

    async def _events(self, generation: Generation, first: Sequence[ChoiceDelta] | None,
                      keepalive_s: float | None) -> AsyncIterator[bytes]:
        framer = EventFramer()
        output = ResponseOutput(framer, self.request.include_logprobs)
        try:
            if first is None:
                yield KEEPALIVE
            created = self._object(output, "in_progress")
            out = [framer.event("response.created", dumps({"response": created})),
                   framer.event("response.in_progress", dumps({"response": created}))]
            finish = self._frame(first, output, out) if first else None
            try:
                async for item in paced(generation, keepalive_s, out):
                    if isinstance(item, bytes):
                        yield item
                    else:
                        finish = self._frame(item, output, out) or finish
            except StreamproxyError as exc:
                out.append(framer.event("error", dumps({"code": exc.code, "message": exc.message,
                                                        "param": None})))
                failed = self._object(output, "failed", generation,
                                      error={"code": exc.code or "server_error", "message": exc.message})
                self._store(failed, output.items)
                out.append(framer.event("response.failed", dumps({"response": failed})))
                yield b"".join(out)
                return
            done = self._finished(output, generation, finish)
            kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
            out.append(framer.event(kind, dumps({"response": done})))
            yield b"".join(out)
        finally:
            self._drop_unfinished()
            await generation.aclose()
