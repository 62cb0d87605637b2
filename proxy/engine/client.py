"""EngineClient: the one typed interface between the API and the engine (vLLM's ``EngineClient``).

The API layer sees the engine only through :class:`EngineClient`: ``generate(prompt_token_ids,
params, n) -> Generation`` plus what it must read (the served model's facts, health, counters for
``/health`` and ``/metrics``). :class:`AsyncEngineClient` is the implementation; it owns output
processing (detokenizer, stop checker, mailboxes, metrics; as vLLM's ``AsyncLLM`` owns its
``OutputProcessor``) and drives the engine core through a small message-like seam,
:class:`EngineCoreClient`: add a request (id, prompt ids, params), abort requests, and receive the
outputs of each step as one list of ``RequestOutput``. ``proxy.engine.async_engine.AsyncEngine``
runs the core on a thread behind that seam; a core in a child process fits the same seam, with
output processing staying in the API process.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

from proxy.engine.generation import Generation
from proxy.engine.mailbox import ChoiceDelta, Mailbox
from proxy.engine.output import OutputProcessor
from proxy.engine.request import RequestOutput
from proxy.engine.stats import MetricsRecorder
from proxy.errors import InvalidRequestError, RateLimitError
from proxy.metrics import Metrics
from proxy.protocol import choice_params, resolve_max_tokens
from proxy.sampling import SamplingParams, StructuredOutputParams
from proxy.tokenizer import Tokenizer

__all__ = [
    "AsyncEngineClient",
    "ChoiceDelta",
    "EngineClient",
    "EngineCoreClient",
    "EngineStats",
    "Generation",
    "ModelInfo",
]

OutputsHandler = Callable[[list[RequestOutput]], None]
FaultInjector = Callable[[], None]

logger = logging.getLogger(__name__)


def deliver_outputs(outputs: list[RequestOutput], live: set[str], on_outputs: OutputsHandler | None) -> None:
    """Hand one step's outputs to ``on_outputs`` on the event loop (both engine core clients' seam).

    Outputs of requests no longer in ``live`` (aborted meanwhile) are dropped; a finished request leaves
    ``live``. An exception of the handler is logged, never raised into the engine's hand-off.
    """
    delivered = [o for o in outputs if o.request_id in live]
    for out in delivered:
        if out.finished:
            live.discard(out.request_id)
    if delivered and on_outputs is not None:
        try:
            on_outputs(delivered)
        except Exception:
            logger.exception("output processing failed for a step of %d outputs", len(delivered))


@dataclass(frozen=True)
class EngineStats:
    """Counters of the engine, for ``/health`` and the ``/metrics`` gauges.

    Attributes:
        num_running: requests in the running batch.
        num_waiting: requests admitted but not running yet.
        kv_cache_usage: fraction of KV blocks in use, in [0, 1].
        num_free_blocks, num_total_blocks: KV blocks (None: the core does not say).
        num_tracked_outputs: engine requests whose outputs output processing still expects.
        num_preemptions: requests preempted (recomputed) so far because the KV cache ran out; a
            growing count means the cache is too small for the load (vLLM's ``num_preemptions``).
        prefix_cache_queries, prefix_cache_hits: prompt tokens looked up in the prefix cache and
            found there, since start.
        num_engine_restarts: times the engine process died and was restarted (``--engine-process``).
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int | None = None
    num_total_blocks: int | None = None
    num_tracked_outputs: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_engine_restarts: int = 0


@dataclass(frozen=True)
class ModelInfo:
    """What the API must know about the served model.

    Attributes:
        served_model_name: the id clients send as ``model``.
        max_model_len: context window in tokens (prompt + output), as the engine enforces it.
        vocab_size: token ids accepted in prompts, ``logit_bias`` and ``stop_token_ids``; None: unchecked.
        created: Unix seconds, for ``/v1/models``.
        dtype: activation dtype served (``"bfloat16"``); None: not reported.
        quantization: what the weights are served as (``proxy.models.LoadedModel.quantization``,
            e.g. ``"gguf: Q4_1 -> int4 g32 x210, Q8_0 -> int8 g32 x1"`` or ``"none"``); None: not reported.
    """

    served_model_name: str
    max_model_len: int
    vocab_size: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    dtype: str | None = None
    quantization: str | None = None


@runtime_checkable
class EngineCoreClient(Protocol):
    """The seam to the engine core (schedule, forward, sample): messages in, step outputs out.

    ``start`` and every call run on the event loop; ``on_outputs`` gets each step's outputs on the
    event loop, once per step. After ``abort_requests`` returns, no output of those requests is
    delivered. Implementations: ``AsyncEngine`` (a thread), ``EngineProcClient`` (a child process,
    ``proxy.engine.core_proc``), the test double ``FakeEngine``.
    """

    fault_injector: FaultInjector | None  # test hook: run before each forward pass

    @property
    def is_healthy(self) -> bool: ...

    def start(self, on_outputs: OutputsHandler) -> None: ...

    def begin_drain(self) -> None:
        """Shutdown has begun: keep serving open requests, but never restart a dead engine again."""

    def shutdown(self) -> None: ...

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Queue a request. Raises RateLimitError (queue full) or EngineDeadError."""

    def abort_requests(self, request_ids: Sequence[str]) -> None: ...

    def stats(self) -> EngineStats: ...


@runtime_checkable
class EngineClient(Protocol):
    """What the API uses of the engine, and nothing else."""

    model: ModelInfo
    tokenizer: Tokenizer
    metrics: Metrics
    fault_injector: FaultInjector | None

    @property
    def is_healthy(self) -> bool: ...

    def start(self) -> None:
        """Start the engine; call from the running event loop that will consume the outputs."""

    def begin_drain(self) -> None:
        """The server drains (SIGTERM): open generations go on; an engine that dies now stays dead."""

    def shutdown(self) -> None: ...

    def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams, n: int = 1,
                 request_id: str | None = None) -> Generation:
        """Start ``n`` choices of one prompt (choice ``i`` seeded ``seed + i``).

        Raises (before anything is generated): ContextLengthExceededError, RateLimitError,
        EngineDeadError.
        """

    def abort_all(self, message: str, code: str) -> int:
        """End every open generation with an error (shutdown); returns how many requests ran."""

    def stats(self) -> EngineStats: ...

    async def prepare_structured_output(self, so: StructuredOutputParams, param: str) -> None:
        """Compile the grammar of ``so`` in a worker thread (cached by its text), before ``generate``,
        so the engine thread only looks it up.

        Raises:
            InvalidRequestError: the spec cannot be enforced (400 naming ``param``), or the engine
                serves no structured outputs.
        """


class StructuredOutputCompiler(Protocol):
    """Compiles (and caches, for the engine core) the grammar of a constrained request: the engine's
    ``GrammarCompiler`` (thread mode) or ``core_proc.ChildGrammarCompiler`` (compiles in the engine
    process). Awaited on the event loop; the compile itself runs elsewhere.

    Raises:
        InvalidRequestError: the spec cannot be enforced (the message names ``param``).
    """

    async def compile_async(self, so: StructuredOutputParams, param: str) -> object: ...


class AsyncEngineClient:
    """:class:`EngineClient` over any :class:`EngineCoreClient`; owns output processing.

    Args:
        core: the engine core's client (``AsyncEngine`` for the in-process thread).
        tokenizer: the served model's tokenizer (detokenization here, chat templates in the API).
        model: facts of the served model.
        grammar_compiler: compiles grammars for the engine core (structured outputs): its
            ``GrammarCompiler``, or a ``ChildGrammarCompiler`` in engine-process mode; None: none served.
    """

    def __init__(self, core: EngineCoreClient, tokenizer: Tokenizer, model: ModelInfo,
                 grammar_compiler: StructuredOutputCompiler | None = None) -> None:
        self.core = core
        self.grammar_compiler = grammar_compiler
        self.tokenizer = tokenizer
        self.model = model
        self.metrics = Metrics(
            model.served_model_name,
            num_running=lambda: self.core.stats().num_running,
            num_waiting=lambda: self.core.stats().num_waiting,
            kv_cache_usage=lambda: self.core.stats().kv_cache_usage,
            num_preemptions=lambda: self.core.stats().num_preemptions,
            prefix_cache_queries=lambda: self.core.stats().prefix_cache_queries,
            prefix_cache_hits=lambda: self.core.stats().prefix_cache_hits,
            num_engine_restarts=lambda: self.core.stats().num_engine_restarts,
        )
        self._processor = OutputProcessor(tokenizer, MetricsRecorder(self.metrics))

    # ---- life cycle and counters -----------------------------------------------------------------

    def start(self) -> None:
        self.core.start(self._on_outputs)

    def begin_drain(self) -> None:
        self.core.begin_drain()

    def shutdown(self) -> None:
        self.core.shutdown()

    @property
    def is_healthy(self) -> bool:
        return self.core.is_healthy

    @property
    def fault_injector(self) -> FaultInjector | None:
        return self.core.fault_injector

    @fault_injector.setter
    def fault_injector(self, fn: FaultInjector | None) -> None:
        self.core.fault_injector = fn

    def stats(self) -> EngineStats:
        return replace(self.core.stats(), num_tracked_outputs=self._processor.num_tracked)

    # ---- requests ----------------------------------------------------------------------------------

    async def prepare_structured_output(self, so: StructuredOutputParams, param: str) -> None:
        """See :meth:`EngineClient.prepare_structured_output`."""
        if self.grammar_compiler is None:
            raise InvalidRequestError("Structured outputs are not available on this server.", param=param)
        await self.grammar_compiler.compile_async(so, param)

    def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams, n: int = 1,
                 request_id: str | None = None) -> Generation:
        """See :meth:`EngineClient.generate`; engine request ids are ``f"{request_id}-{i}"``."""
        resolve_max_tokens(
            params.max_tokens, len(prompt_token_ids), self.model.max_model_len, prompt_name="prompt"
        )
        base = request_id or uuid.uuid4().hex
        mailbox = Mailbox(n)
        added: list[str] = []
        prompt = list(prompt_token_ids)
        try:
            for i in range(n):
                rid = f"{base}-{i}"
                p = choice_params(params, i)
                self._processor.add(rid, mailbox, i, p)
                added.append(rid)
                self.core.add_request(rid, prompt, p)
        except BaseException as exc:
            self._abort(added)
            if isinstance(exc, RateLimitError):
                self.metrics.observe_rejected("queue_full")
            raise
        return Generation(mailbox, added, len(prompt), self._abort)

    def abort_all(self, message: str, code: str) -> int:
        ended = self._processor.fail_all(message, code)
        if ended:
            self.core.abort_requests(ended)
        return len(ended)

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._processor.abort(rid)
        self.core.abort_requests(request_ids)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        to_abort = self._processor.process_outputs(outputs)
        if to_abort:
            self.core.abort_requests(to_abort)
