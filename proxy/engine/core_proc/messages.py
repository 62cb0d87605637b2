"""What crosses the pipe between the API process and the engine process: one frozen dataclass a kind.

Receivers dispatch on the message's type (``match msg: case AddRequest(): ...``), as vLLM's
``EngineCoreRequestType`` names each kind; nothing is read by position.

- parent -> child (the engine core's commands; :class:`~proxy.engine.driver.CoreDriver` applies the
  first three and :class:`ReserveCores`, in-process too): :class:`AddRequest`,
  :class:`AbortRequests`, :class:`Stop`, :class:`ReserveCores`, and :class:`CompileGrammar` (engine
  process only).
- child -> parent: :class:`Progress` and then one :class:`ReadyInfo` or :class:`LoadFailed` while
  loading; then a :class:`StepResult` after every engine step and after commands that change the
  counters (an abort frees blocks), and a :class:`Compiled` when a compile finished.

Cost: pickle writes a dataclass as its class (module and name) and its field dict: a few hundred
bytes and tens of microseconds more than a tuple per message, against an engine step of tens of
milliseconds (measured in ``docs/internals.md``, engine process).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from proxy.engine.client.core_client import EngineStats
from proxy.engine.request import RequestOutput
from proxy.media.prompt import PromptImages
from proxy.sampling import SamplingParams, StructuredOutputParams


@dataclass(frozen=True)
class AddRequest:
    """Queue a request (``EngineCore.add_request``); a refused one ends with ``RequestOutput.failed``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    images: PromptImages | None = None


@dataclass(frozen=True)
class AbortRequests:
    """Abort requests (``EngineCore.abort_request``, idempotent); no output follows."""

    request_ids: list[str]


@dataclass(frozen=True)
class Stop:
    """Fail every live request and end the engine loop."""


@dataclass(frozen=True)
class CompileGrammar:
    """Compile (and cache) the grammar of ``spec``; answered by :class:`Compiled` with ``token``.

    Attributes:
        token: the parent's key of the pending compile.
        spec: the structured-output spec to compile.
        param: the request field named by a refusal (``InvalidRequestError.param``).
    """

    token: int
    spec: StructuredOutputParams
    param: str


@dataclass(frozen=True)
class ReserveCores:
    """Leave ``cores`` CPU cores to other work of this server (another model loading beside this
    one): step with at most the full intra-op thread count less ``cores`` (at least one), until the
    next ``ReserveCores``; 0 gives the full count back (``proxy.engine.driver.CoreDriver``)."""

    cores: int


EngineCommand = AddRequest | AbortRequests | Stop | CompileGrammar | ReserveCores
"""What the parent sends (``EngineProcClient``) and the child's engine loop receives."""


@dataclass(frozen=True)
class Progress:
    """A load step of the child, for the parent's log."""

    text: str


@dataclass(frozen=True)
class LoadFailed:
    """The child could not build its engine (``"ExceptionType: message"``); it exits after sending."""

    reason: str


@dataclass(frozen=True)
class ReadyInfo:
    """What the child reports once its engine is built (the message that ends loading).

    Attributes:
        model_path: the Hugging Face folder it loaded (the API process loads the tokenizer from it).
        served_model_name: the model's id for clients.
        max_model_len: context length in tokens as the engine enforces it.
        eos_token_ids: the generation config's EOS ids (``LoadedModel.eos_token_ids``).
        logits_width: columns of the model's logits (grammar masks cover them all).
        dtype, quantization, execution: as in ``ModelInfo``.
        load_s: seconds from the child's start to ready.
        omp_wait_policy: ``OMP_WAIT_POLICY`` in the child's environment ("": unset, libgomp's
            default; see ``proxy.engine.core_proc.child``).
        stats: the core's counters when it is ready (its KV blocks, all free), so that ``/health``
            reports them before the first step.
        load_nice: the nice value the load ran at (read on the loading thread; the child serves at
            its start's priority; see ``proxy.engine.core_proc.child``).
        serve_nice: the nice value of the thread that serves (the child's main thread).
    """

    model_path: str
    served_model_name: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    logits_width: int
    dtype: str
    quantization: str
    load_s: float
    omp_wait_policy: str
    stats: CoreStats | None = None
    execution: dict[str, Any] | None = None
    load_nice: int = 0
    serve_nice: int = 0


@dataclass(frozen=True)
class CoreStats:
    """The core's counters after a step (``EngineStats`` less what the API process adds).

    Attributes:
        num_running, num_waiting: requests in the running batch / waiting in the core.
        kv_cache_usage: fraction of KV blocks in use, in [0, 1].
        num_free_blocks, num_total_blocks: KV blocks.
        num_preemptions: requests preempted (recomputed) so far.
        prefix_cache_queries, prefix_cache_hits: prompt tokens looked up / found, since start.
        num_adds_taken: ``AddRequest`` commands the core has taken so far (the sender counts the
            ones sent; the difference is waiting too, see ``proxy.engine.admission``).
        num_reserves_taken: :class:`ReserveCores` commands applied so far (the sender counts the
            ones sent: all applied when equal, ``EngineProcClient.cores_reserved``).
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_adds_taken: int
    num_reserves_taken: int = 0

    @classmethod
    def of(cls, core: Any, num_adds_taken: int, num_reserves_taken: int = 0) -> CoreStats:
        """The counters of ``core`` (an ``EngineCore``) now."""
        return cls(core.num_running, core.num_waiting, core.kv_cache_usage, core.num_free_blocks,
                   core.num_total_blocks, core.scheduler.num_preemptions, core.prefix_cache_queries,
                   core.prefix_cache_hits, num_adds_taken, num_reserves_taken)

    def engine_stats(self, num_waiting: int, num_engine_restarts: int = 0) -> EngineStats:
        """These counters as ``EngineStats``, with the client's ``num_waiting`` (adds in flight
        included) and restart count."""
        return EngineStats(self.num_running, num_waiting, self.kv_cache_usage, self.num_free_blocks,
                           self.num_total_blocks, num_preemptions=self.num_preemptions,
                           prefix_cache_queries=self.prefix_cache_queries,
                           prefix_cache_hits=self.prefix_cache_hits, num_engine_restarts=num_engine_restarts)


NO_STATS = CoreStats(0, 0, 0.0, 0, 0, 0, 0, 0, 0)
"""The counters before the first step message."""


@dataclass(frozen=True)
class StepResult:
    """One engine step's outputs (possibly none) and the counters after it."""

    outputs: list[RequestOutput]
    stats: CoreStats


@dataclass(frozen=True)
class CompileFailure:
    """Why a grammar was not compiled.

    Attributes:
        kind: "invalid" (the spec cannot be enforced, a 400), "error" (the compiler failed, a 500) or
            "dead" (set in the API process when the child died or shut down before answering).
        message: what to tell the client.
        param: the request field a refusal names (``InvalidRequestError.param``), else None.
    """

    kind: Literal["invalid", "error", "dead"]
    message: str
    param: str | None = None


@dataclass(frozen=True)
class Compiled:
    """The child's answer to :class:`CompileGrammar` ``token``: ``failure`` None when compiled and cached."""

    token: int
    failure: CompileFailure | None


EngineReply = Progress | LoadFailed | ReadyInfo | StepResult | Compiled
"""What the child sends."""

Send = Callable[[Any], None]  # sends one message (under the sender's lock)
