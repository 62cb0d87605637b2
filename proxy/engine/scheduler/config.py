""":class:`SchedulerConfig`: every knob of the scheduler in one frozen object (vLLM's ``SchedulerConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.settings import Settings, check_prefill_bound

NO_CAP = 1_000_000
"""``max_num_partial_prefills`` that never binds (more prompts than any step can hold)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler may put in one step: the scheduler group of ``streamproxy serve``'s options.
    Built once from ``Settings`` (:meth:`from_settings`) and passed whole to
    :class:`~proxy.engine.scheduler.Scheduler`, which hands it to
    :class:`~proxy.engine.scheduler.StepCostModel` and :class:`~proxy.engine.scheduler.StepBudget`.

    One description per knob: this docstring's is also the ``--help`` of the option of the same name
    (``proxy.cli``), and ``Settings`` does not repeat it. The server's defaults are ``Settings``'
    fields (the one place they are set; ``--help`` shows them); the keyword defaults here are each
    prefill bound's *off* value, so a bare config is plain chunked prefill (tests, embedders).
    ``docs/scheduling.md`` says why the server's defaults are what they are, with the measurements.

    A *decode* is a running request that needs exactly one token (``Request.is_decoding``); a *step
    with decodes* carries at least one. The prefill bounds below apply only to steps with decodes,
    and not to a *burst*: while the measured bound is on, a step is a burst when more waiting
    requests could start (``min(waiting, max_num_seqs - running)``) than there are decodes; its
    prompts take the whole token budget, as in a step without decodes.

    Attributes:
        max_num_seqs: most requests in the running batch (>= 1).
        max_num_batched_tokens: token budget of one engine step, decode tokens and prefill chunks
            together (>= 1; vLLM's OpenAI-server default). A step's prefill chunks are also capped at
            twice this many query rows once each is padded to the longest (``StepBudget.for_step``).
        max_model_len: longest prompt + output in tokens; a request reaching it finishes "length"
            (the server's ``--max-model-len``, lowered to the KV pool's size).
        long_prefill_token_threshold: in a step with decodes, the largest prefill chunk one request
            may add, outside a burst (tokens, the vision encoder's work on its images counted in
            them); 0: only max_num_batched_tokens bounds it.
        max_num_partial_prefills: in a step with decodes, the most requests whose prefill chunks may
            join it, outside a burst (>= 1; a bare config: :data:`NO_CAP`).
        max_prefill_step_ratio: in a step with decodes, prefill tokens join only as many as the
            step-time fit (``StepCostModel``) says keep the step within this many decode-only steps
            of its batch, widened by ``1 + waiting / decoding`` and lifted in a burst; 0: off (no
            fit, no burst rule: the token knobs alone, vLLM's policy). Otherwise > 1.
        max_long_gap_fraction: the measured bound is lifted for a step while steps longer than the
            ratio have made at most this share of recent inter-token gaps, so an occasional prompt
            is prefilled at once; 0: never. In [0, 1).
        prefill_token_multiple: the measured bound gives prefill tokens in multiples of this (the
            rows of one fixed-shape prefill call, the model runner's ``PrefillPlan.call_rows``, where
            the model runs prompt tokens in such calls; else 1).
        outputs_on_decode_path: the model runner computes every output token on its decode path
            (the CPU's compiled decode step), also when a preempted request recomputes them: a
            chunk then never holds prompt and output tokens together, and a step's output tokens
            (decodes and recomputed chunks) stay within ``max_num_seqs`` rows, as a decode step's
            (``Scheduler.chunk_limit``).
        watermark: share of the KV pool (at least one block) a waiting request may not take while
            others run, so running requests can grow without preempting at once (vLLM v0's
            ``watermark``).

    Raises:
        ValueError: a count below its minimum, a negative threshold, a watermark outside [0, 1), or
            the ratios out of range (:func:`proxy.settings.check_prefill_bound`).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = NO_CAP
    max_prefill_step_ratio: float = 0.0
    max_long_gap_fraction: float = 0.0
    prefill_token_multiple: int = 1
    outputs_on_decode_path: bool = False
    watermark: float = 0.01

    def __post_init__(self) -> None:
        if min(self.max_num_seqs, self.max_num_batched_tokens, self.max_num_partial_prefills,
               self.prefill_token_multiple) < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens, max_num_partial_prefills and "
                             "prefill_token_multiple must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        check_prefill_bound(self.max_prefill_step_ratio, self.max_long_gap_fraction)

    @classmethod
    def from_settings(cls, settings: Settings, max_model_len: int, prefill_token_multiple: int = 1,
                      outputs_on_decode_path: bool = False) -> SchedulerConfig:
        """The server's scheduler knobs (``Settings``' fields of the same names).

        Args:
            settings: the server's settings.
            max_model_len: the context length in force (the engine lowers it to the KV pool's size).
            prefill_token_multiple, outputs_on_decode_path: see the class docstring (the engine
                passes its ``PrefillPlan.call_rows`` when it runs one, and True with a compiled decode step).
        """
        return cls(
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=max_model_len,
            long_prefill_token_threshold=settings.long_prefill_token_threshold,
            max_num_partial_prefills=settings.max_num_partial_prefills,
            max_prefill_step_ratio=settings.max_prefill_step_ratio,
            max_long_gap_fraction=settings.max_long_gap_fraction,
            prefill_token_multiple=prefill_token_multiple,
            outputs_on_decode_path=outputs_on_decode_path,
        )

    def watermark_blocks(self, num_total_blocks: int) -> int:
        """KV blocks a waiting request may not take while others run: ``watermark`` of the pool,
        at least 1."""
        return max(1, int(num_total_blocks * self.watermark))
