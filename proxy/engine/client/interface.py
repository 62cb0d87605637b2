"""What the API sees of the engine: the :class:`EngineClient` protocol and the served :class:`ModelInfo`.

``proxy.engine.client.AsyncEngineClient`` implements :class:`EngineClient`; the API layer imports
nothing else of the engine (``tests/test_imports.py``). :class:`StructuredOutputCompiler` is what
``AsyncEngineClient`` awaits to have a grammar compiled for the engine core.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from proxy.engine.client.core_client import EngineStats, FaultInjector
from proxy.engine.generation import Generation
from proxy.media.processor import VisionProcessor
from proxy.media.prompt import PromptImages
from proxy.metrics import Metrics
from proxy.sampling import SamplingParams, StructuredOutputParams
from proxy.tokenizer import Tokenizer


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
            e.g. ``"gguf: Q4_1 -> int4 g32 x210, ..."`` or ``"none"``); None: not reported.
        execution: the engine's execution plan (``proxy.engine.execution.plan.ExecutionPlan.as_dict``); None:
            not reported.
        images_refused: why a vision-language model served as a text model refuses images
            (``proxy.media.processor.images_refusal``, e.g. Llama 4's: its vision tower is not run);
            None: a text model, or one served with its images.
    """

    served_model_name: str
    max_model_len: int
    vocab_size: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    dtype: str | None = None
    quantization: str | None = None
    execution: dict[str, Any] | None = None
    images_refused: str | None = None


@runtime_checkable
class EngineClient(Protocol):
    """What the API uses of the engine, and nothing else."""

    model: ModelInfo
    tokenizer: Tokenizer
    #: the processor of a vision-language model served with its images; None: the model reads text only
    vision: VisionProcessor | None
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
                 request_id: str | None = None, images: PromptImages | None = None) -> Generation:
        """Start ``n`` choices of one prompt (choice ``i`` seeded ``seed + i``); ``images``: the
        prompt's images (a vision-language model's, :attr:`vision`).

        Raises (before anything is generated): ContextLengthExceededError, RateLimitError,
        EngineDeadError.
        """

    def abort_all(self, message: str, code: str) -> int:
        """End every open generation with an error (shutdown); returns how many requests ran."""

    def reserve_cores(self, cores: int) -> None:
        """Step with ``cores`` fewer CPU threads (at least one) until the next call, 0: the full
        count; a several-model server leaves a core to a model loading (``proxy.api.multi``)."""

    def cores_reserved(self) -> bool:
        """Every :meth:`reserve_cores` so far applied (the engine steps with that count now)."""

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
    ``GrammarCompiler`` (thread mode) or ``core_proc.grammar.ChildGrammarCompiler`` (compiles in the engine
    process). Awaited on the event loop; the compile itself runs elsewhere.

    Raises:
        InvalidRequestError: the spec cannot be enforced (the message names ``param``).
    """

    async def compile_async(self, so: StructuredOutputParams, param: str) -> object: ...
