""":class:`AsyncEngineClient`: the :class:`~proxy.engine.client.EngineClient` over any engine core client.

It owns output processing (detokenizer, stop checker, mailboxes, metrics; as vLLM's ``AsyncLLM``
owns its ``OutputProcessor``) and drives the engine core through the
:class:`~proxy.engine.client.EngineCoreClient` seam, in either engine mode.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import replace

from proxy.engine.client.core_client import EngineCoreClient, EngineStats, FaultInjector
from proxy.engine.client.interface import ModelInfo, StructuredOutputCompiler
from proxy.engine.generation import Generation
from proxy.engine.mailbox import Mailbox
from proxy.engine.output import OutputProcessor
from proxy.engine.request import RequestOutput
from proxy.engine.stats import MetricsRecorder
from proxy.errors import InvalidRequestError, RateLimitError
from proxy.media.processor import VisionProcessor
from proxy.media.prompt import PromptImages
from proxy.metrics import Metrics
from proxy.protocol import choice_params, resolve_max_tokens
from proxy.sampling import SamplingParams, StructuredOutputParams
from proxy.tokenizer import Tokenizer


class AsyncEngineClient:
    """:class:`EngineClient` over any :class:`EngineCoreClient`; owns output processing.

    Args:
        core: the engine core's client (``AsyncEngine`` for the in-process thread).
        tokenizer: the served model's tokenizer (detokenization here, chat templates in the API).
        model: facts of the served model.
        grammar_compiler: compiles grammars for the engine core (structured outputs): its
            ``GrammarCompiler``, or a ``ChildGrammarCompiler`` in engine-process mode; None: none served.
        vision: the processor of a vision-language model served with its images; None: text only.
    """

    def __init__(self, core: EngineCoreClient, tokenizer: Tokenizer, model: ModelInfo,
                 grammar_compiler: StructuredOutputCompiler | None = None,
                 vision: VisionProcessor | None = None) -> None:
        self.core = core
        self.vision = vision
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
                 request_id: str | None = None, images: PromptImages | None = None) -> Generation:
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
                self._processor.add(rid, mailbox, i, p, len(prompt))
                added.append(rid)
                self.core.add_request(rid, prompt, p, images)
        except BaseException as exc:
            self._abort(added, observe=False)
            if isinstance(exc, RateLimitError):
                self.metrics.observe_rejected("queue_full")
            raise
        return Generation(mailbox, added, len(prompt), self._abort)

    def reserve_cores(self, cores: int) -> None:
        """See :meth:`EngineClient.reserve_cores`."""
        self.core.reserve_cores(cores)

    def cores_reserved(self) -> bool:
        """See :meth:`EngineClient.cores_reserved`."""
        return self.core.cores_reserved()

    def abort_all(self, message: str, code: str) -> int:
        ended = self._processor.fail_all(message, code)
        if ended:
            self.core.abort_requests(ended)
        return len(ended)

    def _abort(self, request_ids: list[str], *, observe: bool = True) -> None:
        for rid in request_ids:
            self._processor.abort(rid, observe=observe)
        self.core.abort_requests(request_ids)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        to_abort = self._processor.process_outputs(outputs)
        if to_abort:
            self.core.abort_requests(to_abort)
