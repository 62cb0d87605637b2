"""The SSE body of a streaming completion: role chunks, deltas, finish, usage, ``[DONE]``.

Event order per the OpenAI streaming reference (and the cases C13-C17 of ``tests/data/cases/log.md``):

1. chat only: one chunk per choice with ``delta: {"role": "assistant", "content": ""}``;
2. reasoning, content and ``tool_calls`` chunks (``finish_reason: null``), each carrying what the
   choice had pending when the response woke (a lagging client gets fewer, larger chunks);
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

from collections.abc import AsyncIterator, Sequence

from proxy.engine.client import ChoiceDelta, Generation
from proxy.errors import StreamproxyError
from proxy.hotpath import ChunkFramer, dumps
from proxy.pipeline import ChoiceOutput, ChoiceParts
from proxy.protocol import CompletionFormat

KEEPALIVE = b": keepalive\n\n"


def _frame(deltas: Sequence[ChoiceDelta], fmt: CompletionFormat, framer: ChunkFramer,
           outputs: list[ChoiceOutput], text_offsets: list[int], out: list[bytes]) -> None:
    """Append the chunks of ``deltas``: each choice's text split by its :class:`ChoiceOutput` into
    reasoning, content (with the delta's logprobs) and tool-call chunks, then its finish chunk."""
    for d in deltas:
        choice = outputs[d.index]
        parts = choice.feed(d.text)
        finish = d.finish_reason
        if finish is not None:
            last, finish = choice.finish(finish)
            parts = ChoiceParts(parts.reasoning + last.reasoning, parts.content + last.content,
                                parts.calls + last.calls)
        if parts.reasoning:
            out.append(framer.reasoning(d.index, parts.reasoning))
        if parts.content or d.logprobs:
            lp_json = dumps(fmt.logprobs(d.logprobs, text_offsets[d.index])) if d.logprobs else None
            out.append(framer.content(d.index, parts.content, lp_json))
            text_offsets[d.index] += len(parts.content)
        for call in parts.calls:  # one chunk a call delta, as OpenAI streams them
            out.append(framer.tool_calls(d.index, dumps([call.to_openai()])))
        if finish is not None:
            out.append(framer.finish(d.index, finish))


async def paced(generation: Generation, keepalive_s: float | None,
                out: list[bytes]) -> AsyncIterator[bytes | Sequence[ChoiceDelta]]:
    """What a stream body does next: bytes to write now, or the generation's next deltas to frame.

    Before each wait for output it yields what the body has framed into ``out`` so far (then
    empties it), unless the generation has finished (the body's end writes it with the last
    events); after ``keepalive_s`` seconds without output, a ``: keepalive`` comment. Ends when
    every choice has finished.

    Raises:
        StreamproxyError: what the generation raises (an engine error, the shutdown).
    """
    while True:
        if out and not generation.is_finished:
            yield b"".join(out)
            out.clear()
        if not await generation.wait(keepalive_s):
            yield KEEPALIVE
            continue
        try:
            deltas = await generation.__anext__()
        except StopAsyncIteration:
            return
        yield deltas


async def sse_body(generation: Generation, fmt: CompletionFormat, framer: ChunkFramer,
                   outputs: list[ChoiceOutput], *, keepalive_s: float | None, include_usage: bool,
                   first: Sequence[ChoiceDelta] | None) -> AsyncIterator[bytes]:
    """The response body; each yielded item is one socket write of one or more SSE events.

    Args:
        generation: the request's generation (closed when the body ends, however it ends).
        fmt: chat or legacy completions (role chunks, ``logprobs`` shape).
        framer: the hot path's ``ChunkFramer`` for this response.
        outputs: per choice, the splitter of its text (reasoning, content, tool calls).
        keepalive_s: seconds of silence before a ``: keepalive`` comment; None: never.
        include_usage: send the ``choices: []`` usage chunk before ``[DONE]``.
        first: deltas already taken from the generation; None: nothing came within
            ``keepalive_s`` (the request waits in the queue or a long prefill), so the body
            starts with a keep-alive comment and the headers go out now.
    """
    text_offsets = [0] * generation.num_choices
    try:
        out: list[bytes] = []
        if first is None:
            yield KEEPALIVE
        if fmt.is_chat:
            out.extend(framer.role(i) for i in range(generation.num_choices))
        if first:
            _frame(first, fmt, framer, outputs, text_offsets, out)
        try:
            async for item in paced(generation, keepalive_s, out):
                if isinstance(item, bytes):
                    yield item
                else:
                    _frame(item, fmt, framer, outputs, text_offsets, out)
        except StreamproxyError as exc:
            out += [framer.error(exc.message, exc.type, exc.code), framer.done()]
            yield b"".join(out)
            return
        if include_usage:
            usage = generation.usage
            out.append(framer.usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens,
                                    usage.reasoning_tokens))
        out.append(framer.done())
        yield b"".join(out)
    finally:
        await generation.aclose()
