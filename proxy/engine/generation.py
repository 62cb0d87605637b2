"""Generation: the outputs of one API request (``n`` choices), as an async iterator of deltas."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from proxy.engine.mailbox import ChoiceDelta, Mailbox
from proxy.protocol import Usage

logger = logging.getLogger(__name__)


class Generation:
    """What :meth:`EngineClient.generate` returns: every choice of one request, coalesced.

    ``async for deltas in generation`` yields, at each wake-up, a list of :class:`ChoiceDelta`
    (at most one per choice: everything that choice had pending, so a slow consumer gets fewer,
    larger deltas). Iteration ends when every choice has delivered its finish delta. A failure
    (a failed engine step, the engine died, the shutdown grace period ran out) raises the error
    from ``__anext__`` once: :class:`~proxy.errors.EngineError` or
    :class:`~proxy.errors.ServiceUnavailableError` (``code="server_shutdown"``).

    :meth:`aclose` (idempotent) aborts every choice that still runs: the engine frees its KV
    blocks before its next step and no further output is delivered. One ``try/finally`` around
    the iteration therefore covers normal end, client disconnect, error and shutdown. As a safety
    net, a Generation that is garbage-collected without being closed aborts its choices too.

    Args:
        mailbox: the request's mailbox, filled by output processing.
        request_ids: the engine request id of each choice.
        num_prompt_tokens: prompt length, for :attr:`usage`.
        abort: aborts engine requests (output processing and the engine core).
    """

    def __init__(self, mailbox: Mailbox, request_ids: Sequence[str], num_prompt_tokens: int,
                 abort: Callable[[list[str]], None]) -> None:
        self._mailbox = mailbox
        self.request_ids = list(request_ids)
        self.num_prompt_tokens = num_prompt_tokens
        self._abort: Callable[[list[str]], None] | None = abort

    @property
    def num_choices(self) -> int:
        return self._mailbox.num_choices

    @property
    def is_finished(self) -> bool:
        """Every choice delivered its finish delta, or an error is pending."""
        return self._mailbox.is_finished

    @property
    def usage(self) -> Usage:
        """Tokens so far: the prompt, the completion tokens of all choices (EOS included), and the
        prompt tokens of choice 0 served from the prefix cache (0 before it is scheduled)."""
        mailbox = self._mailbox
        return Usage(self.num_prompt_tokens, mailbox.num_output_tokens, mailbox.num_cached_tokens,
                     mailbox.num_reasoning_tokens)

    async def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until a delta, the end or an error is pending; False after ``timeout_s`` seconds
        without (None: no limit). Cancel-safe; used to send keep-alives while idle."""
        if self._mailbox.has_pending or self._mailbox.is_finished:
            return True
        if timeout_s is None:
            await self._mailbox.wait()
            return True
        try:
            await asyncio.wait_for(self._mailbox.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> list[ChoiceDelta]:
        """Everything pending (waits for it); cancel-safe: a cancelled wait loses nothing.

        Raises:
            StopAsyncIteration: every choice finished, the generation was closed, or the error
                was already raised.
            EngineError, ServiceUnavailableError: the generation failed (raised once).
        """
        mailbox = self._mailbox
        while True:
            if self._abort is None:
                raise StopAsyncIteration  # closed (also after the error was raised)
            if mailbox.error is not None:
                self.abort()
                raise mailbox.error
            deltas = mailbox.take()
            if deltas:
                return deltas
            if mailbox.is_finished:
                raise StopAsyncIteration
            await mailbox.wait()

    def abort(self) -> None:
        """Abort every choice (idempotent, synchronous); the iterator then ends."""
        abort, self._abort = self._abort, None
        if abort is not None:
            abort(self.request_ids)

    async def aclose(self) -> None:
        """Abort every choice that still runs (idempotent); never blocks."""
        self.abort()

    def __del__(self) -> None:
        if getattr(self, "_abort", None) is not None:
            try:
                self.abort()
            except Exception:
                logger.exception("aborting an unclosed generation failed")
