"""The SSE body of a streaming completion: role chunks, deltas, finish, usage, ``[DONE]``.

Event order per the OpenAI streaming reference (and the cases C13-C17 of
``../shared/cases/log.md``):

1. chat only: one chunk per choice with ``delta: {"role": "assistant", "content": ""}``;
2. content chunks (``finish_reason: null``), each carrying what the choice had pending when the
   response woke (a lagging client gets fewer, larger chunks);
3. per choice, one chunk with an empty delta and its ``finish_reason``;
4. with ``stream_options.include_usage`` only: one chunk with ``choices: []`` and ``usage``;
5. ``data: [DONE]``.

An engine error after the stream started ends it with ``data: {"error": ...}`` then
``data: [DONE]``, and no finish chunk is fabricated. While nothing is pending for
``keepalive_s`` an SSE comment (``: keepalive``) is sent; clients and the OpenAI SDK ignore
comment lines (WHATWG HTML "server-sent events": a line starting with ``:`` is a comment), while
proxies see traffic and keep the connection open.

The body owns the generation: its ``finally`` closes it, which aborts the engine requests on a
client disconnect (Starlette's ``StreamingResponse`` cancels the body when ``http.disconnect``
arrives), an error, or the end of the server.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Sequence

from proxy.engine.client import ChoiceDelta, Generation
from proxy.errors import StreamproxyError
from proxy.hotpath import ChunkFramer, dumps
from proxy.protocol import CompletionFormat
from proxy.tools.output import ChoiceToolOutput, tool_calls_chunk

KEEPALIVE = b": keepalive\n\n"
_Framing = Callable[[Sequence[ChoiceDelta], CompletionFormat, ChunkFramer, list[int], list[bytes]], None]


def _frame_tools(deltas: Sequence[ChoiceDelta], fmt: CompletionFormat, framer: ChunkFramer,
                 text_offsets: list[int], out: list[bytes], tool_outputs: list[ChoiceToolOutput],
                 chunk_ids: tuple[str, int, str]) -> None:
    """Like :func:`_frame`, with each choice's text split into content and tool-call deltas."""
    for d in deltas:
        tools = tool_outputs[d.index]
        text, calls = tools.feed(d.text)
        finish = d.finish_reason
        if finish is not None:
            last, more, finish = tools.finish(finish)
            text, calls = text + last, calls + more
        if text or d.logprobs:
            lp_json = dumps(fmt.logprobs(d.logprobs, text_offsets[d.index])) if d.logprobs else None
            out.append(framer.content(d.index, text, lp_json))
            text_offsets[d.index] += len(text)
        if calls:
            out.append(tool_calls_chunk(*chunk_ids, d.index, calls))
        if finish is not None:
            out.append(framer.finish(d.index, finish))


def _frame(deltas: Sequence[ChoiceDelta], fmt: CompletionFormat, framer: ChunkFramer, text_offsets: list[int],
           out: list[bytes]) -> None:
    for d in deltas:
        if d.text or d.logprobs:
            lp_json = dumps(fmt.logprobs(d.logprobs, text_offsets[d.index])) if d.logprobs else None
            out.append(framer.content(d.index, d.text, lp_json))
            text_offsets[d.index] += len(d.text)
        if d.finish_reason is not None:
            out.append(framer.finish(d.index, d.finish_reason))


async def sse_body(generation: Generation, fmt: CompletionFormat, framer: ChunkFramer, *,
                   keepalive_s: float | None, include_usage: bool, first: Sequence[ChoiceDelta] | None,
                   tool_outputs: list[ChoiceToolOutput] | None = None,
                   chunk_ids: tuple[str, int, str] = ("", 0, "")) -> AsyncIterator[bytes]:
    """The response body; each yielded item is one socket write of one or more SSE events.

    Args:
        generation: the request's generation (closed when the body ends, however it ends).
        fmt: chat or legacy completions (role chunks, ``logprobs`` shape).
        framer: the hot path's ``ChunkFramer`` for this response.
        keepalive_s: seconds of silence before a ``: keepalive`` comment; None: never.
        include_usage: send the ``choices: []`` usage chunk before ``[DONE]``.
        first: deltas already taken from the generation; None: nothing came within
            ``keepalive_s`` (the request waits in the queue or a long prefill), so the body
            starts with a keep-alive comment and the headers go out now.
        tool_outputs: per choice, the tool-call splitter (chat with tools); None: plain text.
        chunk_ids: ``(response id, created, model)`` of the chunks, for the ``tool_calls`` chunks.
    """
    text_offsets = [0] * generation.num_choices
    _frame_any: _Framing = _frame
    if tool_outputs is not None:
        _frame_any = functools.partial(_frame_tools, tool_outputs=tool_outputs, chunk_ids=chunk_ids)
    try:
        out: list[bytes] = []
        if first is None:
            yield KEEPALIVE
        if fmt.is_chat:
            out.extend(framer.role(i) for i in range(generation.num_choices))
        if first:
            _frame_any(first, fmt, framer, text_offsets, out)
        while True:
            if out and not generation.is_finished:
                yield b"".join(out)
                out = []
            if not await generation.wait(keepalive_s):
                yield KEEPALIVE
                continue
            try:
                deltas = await generation.__anext__()
            except StopAsyncIteration:
                break
            except StreamproxyError as exc:
                out += [framer.error(exc.message, exc.type, exc.code), framer.done()]
                yield b"".join(out)
                return
            _frame_any(deltas, fmt, framer, text_offsets, out)
        if include_usage:
            usage = generation.usage
            out.append(framer.usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens))
        out.append(framer.done())
        yield b"".join(out)
    finally:
        await generation.aclose()
