"""EngineCore: the synchronous engine loop body, ``step() = schedule -> execute -> sample -> update``.

Not thread-safe: one thread (the ``AsyncEngine``'s engine thread, or a test) drives it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from proxy.engine.block_manager import BlockManager
from proxy.engine.execution.choice import ExecutionChoice
from proxy.engine.execution.model_runner import ModelRunner
from proxy.engine.execution.plan import describe_execution
from proxy.engine.execution.sampler import Sampler
from proxy.engine.request import IMAGE_ENCODING_FAILED, Request, RequestOutput
from proxy.engine.scheduler import Scheduler, SchedulerConfig
from proxy.errors import InvalidRequestError
from proxy.media.prompt import PromptImages
from proxy.protocol import resolve_max_tokens
from proxy.sampling import SamplingParams
from proxy.settings import Settings

if TYPE_CHECKING:
    from proxy.engine.structured import GrammarCompiler

logger = logging.getLogger(__name__)


class EngineCore:
    """Continuous batching over a paged KV cache for one transformers causal LM.

    Args:
        model: the causal LM (switched to the paged attention implementation if needed).
        settings: the scheduler's knobs (``SchedulerConfig.from_settings``), ``block_size``, KV pool
            size, ``enable_prefix_caching``, ``seed``.
        eos_token_ids: ids that finish a request with "stop" (unless ``ignore_eos``).
        max_model_len: longest prompt + output in tokens; lowered to the KV pool's capacity
            (``num_blocks * block_size``) when the pool is smaller.
        grammar_compiler: compiles the grammars of constrained requests (structured outputs, tool
            calls); None: requests with ``params.structured_outputs`` are refused.
        choice: what runs (``proxy.engine.execution.choice.ExecutionChoice``), as chosen before the model
            loaded; None: chosen for the model's device (:class:`ModelRunner`).

    Attributes:
        max_model_len: the context length in force (what the API must check requests against).
        execution: the kernels serving its steps (``proxy.engine.execution.plan.ExecutionPlan``).
        fault_injector: test hook, a callable run before each forward pass; an exception from it
            fails that step's requests like any step failure.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        settings: Settings,
        eos_token_ids: Iterable[int],
        max_model_len: int,
        grammar_compiler: GrammarCompiler | None = None,
        choice: ExecutionChoice | None = None,
    ) -> None:
        self.settings = settings
        self.eos_token_ids = frozenset(eos_token_ids)
        self.runner = ModelRunner(model, settings, max_model_len, choice)
        kv_capacity = self.runner.kv_cache.num_blocks * settings.block_size
        if kv_capacity < max_model_len:
            # One request must always fit in the pool, or it would be cut short with "length" (vLLM
            # refuses to start here; lowering the context keeps the server usable and honest).
            logger.warning(
                "the KV cache holds %d tokens, fewer than max_model_len %d: max_model_len is lowered to %d",
                kv_capacity, max_model_len, kv_capacity,
            )
            max_model_len = kv_capacity
        self.max_model_len = max_model_len
        # output tokens through other kernels than prompt tokens: their KV blocks are not prompt blocks
        on_decode_path = self.runner.compiled_step is not None
        prefill = self.runner.prefill_plan
        self.block_manager = BlockManager(
            self.runner.kv_cache.num_blocks, settings.block_size, settings.enable_prefix_caching,
            output_blocks_apart=prefill is not None or on_decode_path,
        )
        # a prefill chunk below one dense call's rows costs the whole call
        config = SchedulerConfig.from_settings(
            settings, max_model_len, prefill_token_multiple=prefill.call_rows if prefill is not None else 1,
            outputs_on_decode_path=on_decode_path)
        self.scheduler = Scheduler(self.block_manager, config, self.eos_token_ids)
        if self.runner.images is not None:  # the vision encoder's work counts in the step budget
            self.scheduler.encoder_cost = self.runner.images.pending_cost
        # an image block's rows attend to each other both ways: computed in one chunk
        self.scheduler.whole_image_blocks = self.runner.image_blocks
        self.sampler = Sampler(self.runner.device, self.eos_token_ids, settings.seed, grammar_compiler)
        #: which kernels serve the steps, and why the others do not (logged once served)
        self.execution = describe_execution(settings, model, self.runner)
        self.fault_injector: Callable[[], None] | None = None
        self.num_steps = 0

    # ---- counts -----------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        """Requests waiting to be scheduled."""
        return self.scheduler.num_waiting

    @property
    def num_free_blocks(self) -> int:
        """Free KV blocks."""
        return self.block_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        """KV blocks in the pool."""
        return self.block_manager.num_total_blocks

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use."""
        return self.block_manager.usage

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache so far (vLLM's ``prefix_cache_queries``)."""
        return self.block_manager.num_queries_tokens

    @property
    def prefix_cache_hits(self) -> int:
        """Prompt tokens found in the prefix cache so far (vLLM's ``prefix_cache_hits``)."""
        return self.block_manager.num_hit_tokens

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return self.scheduler.has_unfinished()

    # ---- requests ---------------------------------------------------------------------------------

    def check_prompt(self, num_prompt_tokens: int) -> None:
        """Validate a prompt length against the context (``proxy.protocol.resolve_max_tokens``, the
        one context check; ``max_model_len`` is never above the KV pool's capacity).

        Raises:
            InvalidRequestError: empty prompt.
            ContextLengthExceededError: ``num_prompt_tokens >= max_model_len`` (no room for output).
        """
        resolve_max_tokens(None, num_prompt_tokens, self.max_model_len, prompt_name="prompt")

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    images: PromptImages | None = None) -> None:
        """Queue a request.

        Raises:
            InvalidRequestError, ContextLengthExceededError: see ``check_prompt``; also a constrained
                request when the engine has no grammar compiler.
            ValueError: duplicate live request id.
        """
        self.check_prompt(len(prompt_token_ids))
        if params.structured_outputs is not None and self.sampler.grammar_compiler is None:
            raise InvalidRequestError(
                "structured outputs are not enabled on this engine", param="response_format"
            )
        self.scheduler.add_request(Request(request_id, list(prompt_token_ids), params, images=images))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a live request and free its blocks now (idempotent).

        Returns:
            its final output (``finish_reason="abort"``), or None when unknown / already finished.
        """
        output = self.scheduler.abort_request(request_id)
        if output is not None:
            self._retire([output])
        return output

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every live request with ``finish_reason="error"`` (shutdown, engine death)."""
        return self._retire(self.scheduler.fail_all(message))

    # ---- the step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step.

        Returns:
            one ``RequestOutput`` per request that got a new token or finished. If the forward pass
            or sampling raises, every request of the step is finished with ``finish_reason="error"``
            and the message, its blocks are freed, and the engine stays usable. If the vision
            encoder raises on a request's images, only that request (and the step's requests with
            the same images or reading the blocks it writes) finishes so, with ``error_code``
            ``IMAGE_ENCODING_FAILED`` (``proxy.engine.execution.image_embeds``).
        """
        scheduler = self.scheduler
        sched = scheduler.schedule()
        if sched.is_empty:
            return self._retire(scheduler.update(sched, []))
        self.num_steps += 1
        images = self.runner.images
        try:
            if self.fault_injector is not None:
                self.fault_injector()
            start = time.perf_counter()
            failed = images.encode_step(sched, self.settings.block_size) if images is not None else {}
            logits = self.runner.execute(sched)
            sampling = [sched.requests[i] for i in sched.sample_indices]
            tokens, logprobs = self.sampler.sample(logits, sampling)  # a list: the device is done
            prefill = sum(sched.num_new_tokens) - sched.num_decodes + sched.num_encoder_tokens
            scheduler.step_cost.observe(sched.num_decodes, prefill, time.perf_counter() - start)
        except Exception as exc:
            logger.exception("engine step failed; failing its %d requests", len(sched.requests))
            message = f"engine step failed: {type(exc).__name__}: {exc}"
            return self._retire(scheduler.fail_step(sched, message))
        outputs = scheduler.fail_images(failed, IMAGE_ENCODING_FAILED) if failed else []
        return self._retire(outputs + scheduler.update(sched, tokens, logprobs))

    def _retire(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Drop the sampler's state of every finished request among ``outputs`` (the one place it is
        dropped: every way a request ends yields its final output here); returns ``outputs``."""
        for out in outputs:
            if out.finished:
                self.sampler.forget(out.request_id)
        return outputs
