"""Grammar compiles across the pipe: the API process's half of the ``CompileGrammar`` exchange.

Grammars (structured outputs, tool calls) are compiled once, in the child, where the masks are
applied: the API process has no grammar compiler of its own. ``ChildGrammarCompiler.compile_async``
(awaited by ``AsyncEngineClient.prepare_structured_output`` before ``generate``) sends
``CompileGrammar`` and awaits the ``Compiled`` answer; the child compiles on its
``GrammarCompiler``'s executor (nice 19; xgrammar releases the GIL), so its engine loop keeps
stepping, caches the grammar and answers. A refused spec is a 400 naming ``param`` before the
request is sent, as in thread mode; the ``AddRequest`` that follows finds the grammar in the child's
cache. Why not compile in the API process and ship the
result: xgrammar's ``CompiledGrammar.serialize_json`` of a 60-field schema is 27 MB and took 2.5 s
(1 s to load back) against 64 ms to compile it; compiling in both processes (as before) spent the
time twice, the second time on the child's engine loop, stalling every stream.

Here: :class:`PendingCompiles` (the compiles sent and not answered yet), :func:`raise_for_failure`,
and :class:`ChildGrammarCompiler`. The child's half is ``proxy.engine.core_proc.child.compile_and_answer``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
from collections.abc import Awaitable, Callable

from proxy.engine.core_proc.messages import CompileFailure
from proxy.errors import EngineDeadError, InvalidRequestError
from proxy.sampling import StructuredOutputParams

CompileAnswer = CompileFailure | None  # None: compiled and cached


class PendingCompiles:
    """The compiles sent to the child and not answered yet, each a future under a token.

    Opened on the event loop, answered on the reader thread (or failed when the child is gone).
    """

    def __init__(self) -> None:
        self._futures: dict[int, concurrent.futures.Future[CompileAnswer]] = {}
        self._tokens = itertools.count()

    def open(self) -> tuple[int, concurrent.futures.Future[CompileAnswer]]:
        """A new token and the future its answer will complete."""
        future: concurrent.futures.Future[CompileAnswer] = concurrent.futures.Future()
        token = next(self._tokens)
        self._futures[token] = future
        return token, future

    def discard(self, token: int) -> None:
        """Forget a compile that was never sent."""
        self._futures.pop(token, None)

    def answer(self, token: int, answer: CompileAnswer) -> None:
        """Complete the compile of ``token`` with the child's answer (unknown tokens are ignored)."""
        future = self._futures.pop(token, None)
        if future is not None:
            future.set_result(answer)

    def fail_all(self, message: str) -> None:
        """Answer every open compile with a "dead" failure (the child died or shut down)."""
        while self._futures:
            with contextlib.suppress(KeyError):
                _, future = self._futures.popitem()
                if not future.done():
                    future.set_result(CompileFailure("dead", message))


def raise_for_failure(failure: CompileAnswer) -> None:
    """Return when the child compiled the grammar; else raise what its answer says.

    Raises:
        InvalidRequestError: the spec cannot be enforced (the message names its ``param``).
        EngineDeadError: the engine process died or shut down before answering.
        RuntimeError: the compiler failed otherwise (a 500).
    """
    if failure is None:
        return
    if failure.kind == "invalid":
        raise InvalidRequestError(failure.message, param=failure.param)
    if failure.kind == "dead":
        raise EngineDeadError(failure.message)
    raise RuntimeError(f"compiling the grammar failed in the engine process: {failure.message}")


class ChildGrammarCompiler:
    """The API process's grammar compiler in engine-process mode: compiles in the engine process.

    ``AsyncEngineClient.prepare_structured_output`` awaits :meth:`compile_async`, which returns once
    the child has compiled and cached the grammar (see the module docs for why the grammar is not
    compiled in this process).

    Args:
        compile_grammar: ``EngineProcClient.compile_grammar`` (sends the compile, awaits the answer).
    """

    def __init__(self, compile_grammar: Callable[[StructuredOutputParams, str], Awaitable[None]]) -> None:
        self._compile_grammar = compile_grammar

    async def compile_async(self, so: StructuredOutputParams, param: str = "response_format") -> None:
        """See ``EngineProcClient.compile_grammar``."""
        await self._compile_grammar(so, param)
