"""The SSE body of a streaming completion: role chunks, deltas, finish, usage, ``[DONE]``.

Event order per the OpenAI streaming reference (and the cases C13-C17 of
``../shared/cases/log.md``):

1. chat only: one chunk per choice with ``delta: {"role": "assistant", "content": ""}``;
2. content chunks (``finish_reason: null``), each carrying what the mailbox had pending when the
   response woke (a lagging client gets fewer, larger chunks);
3. per choice, one chunk with an empty delta and its ``finish_reason``;
4. with ``stream_options.include_usage`` only: one chunk with ``choices: []`` and ``usage``;
5. ``data: [DONE]``.

An engine error after the stream started ends it with ``data: {"error": ...}`` then
``data: [DONE]``, and no finish chunk is fabricated. While nothing is pending for
``keepalive_interval_s`` an SSE comment (``: keepalive``) is sent; clients and the OpenAI SDK
ignore comment lines (WHATWG HTML "server-sent events": a line starting with ``:`` is a comment),
while proxies see traffic and keep the connection open. A request that waits in the queue or in a
long prefill gets its headers and a first comment after ``keepalive_interval_s`` (``routes``
passes ``started_idle=True``). Leaving the generator early
(client disconnect: the response task is cancelled or the disconnect watcher wakes the mailbox)
runs ``on_close``, which aborts the engine requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from proxy.engine.output import ChoiceDelta, Mailbox, chat_logprobs, completion_logprobs

KEEPALIVE = b": keepalive\n\n"


async def wait_pending(mailbox: Mailbox, timeout_s: float | None) -> bool:
    """Wait until the mailbox has something pending; False after ``timeout_s`` seconds without."""
    if timeout_s is None:
        await mailbox.wait()
        return True
    try:
        await asyncio.wait_for(mailbox.wait(), timeout_s)
    except asyncio.TimeoutError:
        return False
    return True


class SseStream:
    """Frames a :class:`Mailbox` as SSE bytes with the hot path's ``ChunkFramer``.

    Args:
        mailbox: the request's mailbox (one slot per choice).
        framer: ``ChunkFramer`` for ``chat.completion.chunk`` or ``text_completion``.
        is_chat: chat (role chunk, ``logprobs.content``) or legacy completions (``text``,
            legacy ``logprobs``).
        num_prompt_tokens: for the usage chunk.
        include_usage: send the ``choices: []`` usage chunk before ``[DONE]``.
        is_interrupted: True once the client is gone (checked at each wake-up).
        on_close: called exactly once when the body ends, normally or not.
        dumps: canonical compact JSON (``proxy.hotpath.dumps``) for ``logprobs_json``.
        keepalive_interval_s: seconds between keep-alive comments while idle.
        started_idle: the engine has produced nothing yet (the request waits in the queue or in
            prefill): the body starts with a keep-alive comment, so headers go out now.
    """

    def __init__(self, mailbox: Mailbox, framer: Any, *, is_chat: bool, num_prompt_tokens: int,
                 include_usage: bool, is_interrupted: Callable[[], bool], on_close: Callable[[], None],
                 dumps: Callable[[Any], str], keepalive_interval_s: float | None,
                 started_idle: bool = False) -> None:
        self._mailbox = mailbox
        self._framer = framer
        self._is_chat = is_chat
        self._num_prompt_tokens = num_prompt_tokens
        self._include_usage = include_usage
        self._is_interrupted = is_interrupted
        self._on_close = on_close
        self._dumps = dumps
        self._keepalive_s = keepalive_interval_s
        self._text_offsets = [0] * mailbox.num_choices
        self._started_idle = started_idle

    def _frame_deltas(self, deltas: list[ChoiceDelta], out: list[bytes]) -> None:
        framer = self._framer
        for d in deltas:
            if d.text or d.logprobs:
                lp_json = None
                if d.logprobs:
                    if self._is_chat:
                        lp_json = self._dumps(chat_logprobs(d.logprobs))
                    else:
                        lp_json = self._dumps(completion_logprobs(d.logprobs, self._text_offsets[d.index]))
                out.append(framer.content(d.index, d.text, lp_json))
                self._text_offsets[d.index] += len(d.text)
            if d.finish_reason is not None:
                out.append(framer.finish(d.index, d.finish_reason))

    async def body(self) -> AsyncIterator[bytes]:
        """The response body; each yielded item is one socket write of one or more events."""
        mailbox, framer = self._mailbox, self._framer
        try:
            out: list[bytes] = []
            if self._started_idle:
                yield KEEPALIVE
            if self._is_chat:
                out.extend(framer.role(i) for i in range(mailbox.num_choices))
            while True:
                if self._is_interrupted():
                    return
                if mailbox.error is not None:
                    out.append(framer.error(mailbox.error, "server_error", mailbox.error_code))
                    out.append(framer.done())
                    yield b"".join(out)
                    return
                self._frame_deltas(mailbox.take(), out)
                if mailbox.error is not None:
                    continue
                if mailbox.is_finished:
                    if self._include_usage:
                        out.append(framer.usage(self._num_prompt_tokens, mailbox.num_output_tokens))
                    out.append(framer.done())
                    yield b"".join(out)
                    return
                if out:
                    yield b"".join(out)
                    out = []
                if not await wait_pending(mailbox, self._keepalive_s):
                    yield KEEPALIVE
        finally:
            self._on_close()
