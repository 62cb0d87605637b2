"""The vision encoder's work in the step budget (no torch).

A prompt's images are encoded, all together, by the step that computes the first of their
placeholder tokens (``proxy.engine.execution.image_embeds``), inside that step's time: every running
stream waits for it. So the scheduler counts that work as prefill cost of the step, as vLLM's
scheduler counts encoder inputs against its ``encoder_compute_budget`` (``vllm/v1/core/sched/
scheduler.py``, ``_try_schedule_encoder_inputs``): the chunk that reaches the placeholder of images
not encoded yet costs their :data:`EncoderCost` more, in prefill tokens, under the same bounds as its
tokens (``StepBudget.prefill_chunk``). Images already encoded (kept on the request while its prompt
runs, or found in the encoder cache by content hash) cost nothing. A preempted request's images
cost again when they are encoded again.
"""

from __future__ import annotations

from collections.abc import Callable

from proxy.engine.request import Request

EncoderCost = Callable[[Request], int]
"""``request -> the prefill-token cost of encoding its images now`` (0: nothing to encode), the model
runner's ``ImageEncoder.pending_cost``; the scheduler's default (a text model) is :func:`no_encoder`."""


def no_encoder(request: Request) -> int:
    """The :data:`EncoderCost` of a model without a vision encoder: 0."""
    return 0


def images_ahead(request: Request, num_computed: int, encoder_cost: EncoderCost) -> tuple[int | None, int]:
    """``(tokens from num_computed to the first image placeholder at or after it, the encoder cost of
    the request's images)`` while that placeholder is in its prompt and its images still need the
    encoder; ``(None, 0)`` otherwise."""
    images = request.images
    if images is None or num_computed >= request.num_prompt_tokens:
        return None, 0
    first = images.first_at_or_after(num_computed)
    if first is None:
        return None, 0
    cost = encoder_cost(request)
    return (first - num_computed, cost) if cost > 0 else (None, 0)
