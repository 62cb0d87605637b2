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
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from proxy.engine.client import ChoiceDelta, EngineClient, Generation
from proxy.protocol import ChoiceResult, CompletionFormat, LogprobEntry, StreamOptions
from proxy.sampling import SamplingParams
from proxy.tools.output import ChoiceToolOutput
from proxy.tools.request import ChatTools

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


async def _collect(generation: Generation, wants_logprobs: bool) -> list[ChoiceResult]:
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


async def _first_deltas(generation: Generation, timeout_s: float | None) -> list[ChoiceDelta] | None:
    """The first deltas, or None when nothing came within ``timeout_s`` seconds."""
    if not await generation.wait(timeout_s):
        return None
    return await generation.__anext__()


def _with_tool_calls(body: dict[str, Any], outputs: list[ChoiceToolOutput]) -> dict[str, Any]:
    """The non-stream chat body with each choice's text split into content and ``tool_calls``."""
    for choice, out in zip(body["choices"], outputs):
        out.feed(choice["message"]["content"])
        _, _, choice["finish_reason"] = out.finish(choice["finish_reason"])
        choice["message"] = out.message()
    return body


async def respond(request: Request, client: EngineClient, fmt: CompletionFormat, prompt_ids: list[int],
                  params: SamplingParams, n: int, stream: StreamOptions, keepalive_s: float | None,
                  headers_timeout_s: float | None = None, *, tools: ChatTools | None = None,
                  parser_name: str | None = None) -> Response:
    """Generate ``n`` choices for ``prompt_ids`` and answer in ``fmt``.

    ``keepalive_s``: seconds of silence between SSE comments (None: never). ``headers_timeout_s``: the
    longest a stream waits for its first output before its headers go out (None: ``keepalive_s``).
    With ``tools`` (chat), each choice's output goes through a
    :class:`~proxy.tools.output.ChoiceToolOutput` (``parser_name`` for ``tool_choice: "auto"``).

    Raises (before any byte is sent, so the client gets a JSON error with its status):
        RateLimitError, EngineDeadError, ContextLengthExceededError: from ``generate``.
        EngineError, ServiceUnavailableError: the generation failed before its first output
            (stream) or at any point (non-stream).
        ClientDisconnect: the client left first (answered 499, which nobody reads).
    """
    response_id = f"{fmt.id_prefix}-{uuid.uuid4().hex}"
    created = int(time.time())
    model = client.model.served_model_name
    generation = client.generate(prompt_ids, params, n, request_id=response_id)
    tool_outputs = [ChoiceToolOutput(tools, parser_name) for _ in range(n)] if tools is not None else None
    handed_to_body = False
    try:
        if not stream.stream:
            results = await unless_disconnected(request, _collect(generation, params.logprobs))
            reply = fmt.body(response_id, created, model, results, generation.usage)
            if tool_outputs is not None:
                reply = _with_tool_calls(reply, tool_outputs)
            return json_response(reply)
        waits = [t for t in (keepalive_s, headers_timeout_s) if t is not None]
        first = await unless_disconnected(request, _first_deltas(generation, min(waits) if waits else None))
        body = sse_body(generation, fmt, fmt.framer(response_id, created, model, stream.include_usage),
                        keepalive_s=keepalive_s, include_usage=stream.include_usage, first=first,
                        tool_outputs=tool_outputs, chunk_ids=(response_id, created, model))
        handed_to_body = True
        return StreamingResponse(body, headers=dict(SSE_HEADERS), media_type=SSE_MEDIA_TYPE)
    finally:
        if not handed_to_body:
            await generation.aclose()

