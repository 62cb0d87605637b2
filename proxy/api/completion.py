"""One completion request, after validation: generate, then answer as SSE or as one JSON body.

``respond`` holds the one ``try/finally`` around a generation: whatever ends the request (the
last token, a client disconnect, an engine error, the shutdown grace period) ends in
``generation.aclose()``, which aborts what still runs. A stream hands the generation to its body
(:func:`proxy.api.streaming.sse_body`), whose own ``finally`` closes it.

A streaming request first waits for its first output, up to ``stream_headers_timeout_s`` (1 s; at
most ``keepalive_interval_s``), so that an early engine failure is still a plain JSON error with its
HTTP status; if nothing came by then (the request waits in the queue or in a long prefill) the
headers and a keep-alive comment go out, and from then on errors travel in-band (SSE error event +
``[DONE]``). Statuses decided before admission (400, 413, 429, 503) stay statuses. Until the response
starts, and for a non-stream request throughout, :func:`unless_disconnected` watches for the
client leaving; once a stream runs, Starlette's ``StreamingResponse`` does.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from proxy.engine.client import ChoiceDelta, EngineClient, Generation
from proxy.pipeline import ChoiceOutput, PreparedRequest
from proxy.protocol import ChoiceResult, CompletionFormat, LogprobEntry
from proxy.settings import Settings

from .responses import SSE_HEADERS, SSE_MEDIA_TYPE, json_response
from .streaming import sse_body

T = TypeVar("T")


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """The result of ``awaitable``, or ``ClientDisconnect`` as soon as the client goes away
    (then ``awaitable`` is cancelled). Call only after the body was read."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    raise ClientDisconnect()


async def collect(generation: Generation, wants_logprobs: bool) -> list[ChoiceResult]:
    """Every choice of ``generation`` whole (text, logprobs when wanted, finish reason)."""
    n = generation.num_choices
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[LogprobEntry]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    async for deltas in generation:
        for d in deltas:
            texts[d.index].append(d.text)
            logprobs[d.index].extend(d.logprobs)
            if d.finish_reason is not None:
                finish[d.index] = d.finish_reason
    return [ChoiceResult(i, "".join(texts[i]), logprobs[i] if wants_logprobs else None, finish[i])
            for i in range(n)]


async def first_deltas(generation: Generation, timeout_s: float | None) -> list[ChoiceDelta] | None:
    """The first deltas, or None when nothing came within ``timeout_s`` seconds."""
    if not await generation.wait(timeout_s):
        return None
    return await generation.__anext__()


def headers_wait_s(settings: Settings) -> float | None:
    """The longest a stream waits for its first output before its headers go out (seconds; None:
    until it comes): the smaller of the keep-alive interval and ``stream_headers_timeout_s``."""
    waits = [t for t in (settings.keepalive_interval_s, settings.stream_headers_timeout_s) if t]
    return min(waits) if waits else None


def _split_messages(body: dict[str, Any], outputs: list[ChoiceOutput]) -> dict[str, Any]:
    """The non-stream chat body with each choice's text split into its message's fields (content,
    ``tool_calls``) by the same :class:`~proxy.pipeline.ChoiceOutput` a stream goes through."""
    for choice, out in zip(body["choices"], outputs):
        out.feed(choice["message"]["content"])
        _, choice["finish_reason"] = out.finish(choice["finish_reason"])
        choice["message"] = out.message()
    return body


async def serve_generation(
    request: Request, generation: Generation, settings: Settings, stream: bool,
    whole: Callable[[], Awaitable[Any]],
    events: Callable[[list[ChoiceDelta] | None], AsyncIterator[bytes]],
    unanswered: Callable[[], None] | None = None,
) -> Response:
    """Answer ``generation`` as one JSON body (``whole()``'s value) or as SSE (``events(first)``,
    ``first`` the deltas that came before the headers went out, or None), every wire format's one
    shape of a request's life: the generation is closed here unless the streamed body took it over
    (then the body's own ``finally`` closes it); ``unanswered`` runs first then (a stored response
    that will never end is dropped).

    Raises (before any byte is sent): as :func:`respond`.
    """
    handed_to_body = False
    try:
        if not stream:
            return json_response(await unless_disconnected(request, whole()))
        first = await unless_disconnected(request, first_deltas(generation, headers_wait_s(settings)))
        body = events(first)
        handed_to_body = True
        return StreamingResponse(body, headers=dict(SSE_HEADERS), media_type=SSE_MEDIA_TYPE)
    finally:
        if not handed_to_body:
            if unanswered is not None:
                unanswered()
            await generation.aclose()


async def respond(request: Request, client: EngineClient, fmt: CompletionFormat, prepared: PreparedRequest,
                  settings: Settings) -> Response:
    """Generate the choices of ``prepared`` and answer in ``fmt``, as SSE or as one JSON body.

    ``settings.keepalive_interval_s``: seconds of silence between SSE comments (0: never);
    ``settings.stream_headers_timeout_s``: the longest a stream waits for its first output before
    its headers go out (0: the keep-alive interval). Each choice's text goes through a
    :class:`~proxy.pipeline.ChoiceOutput` (content, tool calls).

    Raises (before any byte is sent, so the client gets a JSON error with its status):
        RateLimitError, EngineDeadError, ContextLengthExceededError: from ``generate``.
        EngineError, ServiceUnavailableError: the generation failed before its first output
            (stream) or at any point (non-stream).
        ClientDisconnect: the client left first (answered 499, which nobody reads).
    """
    response_id = f"{fmt.id_prefix}-{uuid.uuid4().hex}"
    created = int(time.time())
    model = client.model.served_model_name
    params, n, stream = prepared.params, prepared.n, prepared.stream
    keepalive_s = settings.keepalive_interval_s or None
    generation = client.generate(prepared.prompt_ids, params, n, request_id=response_id,
                                 images=prepared.images)
    outputs = [prepared.choice_output() for _ in range(n)]

    async def whole() -> dict[str, Any]:
        results = await collect(generation, params.logprobs)
        reply = fmt.body(response_id, created, model, results, generation.usage)
        return _split_messages(reply, outputs) if fmt.is_chat else reply

    def events(first: list[ChoiceDelta] | None) -> AsyncIterator[bytes]:
        framer = fmt.framer(response_id, created, model, stream.include_usage)
        return sse_body(generation, fmt, framer, outputs, keepalive_s=keepalive_s,
                        include_usage=stream.include_usage, first=first)

    return await serve_generation(request, generation, settings, stream.stream, whole, events)
