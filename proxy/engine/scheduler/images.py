"""The vision encoder's work in the step budget (no torch).

A prompt's images are encoded in pieces (``proxy.media.pieces``: a view, an image, or the prompt's
images together, per architecture), each by the step whose chunk first holds one of its placeholder
tokens (``proxy.engine.execution.image_embeds``), inside that step's time: every running stream waits
for it. So the scheduler counts that work as prefill cost of the step, as vLLM's scheduler counts each
multimodal item's encoder input against its ``encoder_compute_budget`` (``vllm/v1/core/sched/
scheduler.py``, ``_try_schedule_encoder_inputs``): a chunk costs the :data:`EncoderCost` of each piece
not encoded yet whose placeholders it reaches, in prefill tokens, under the same bounds as its tokens,
and stops before the placeholders of the first piece the bounds leave no room for
(``StepBudget.prefill_chunk``), so the next steps encode the rest. Pieces already encoded (kept on the
request while its prompt runs, or found in the encoder cache by content hash) cost nothing. A
preempted request's pieces cost again when they are encoded again.
"""

from __future__ import annotations

from collections.abc import Callable

from proxy.engine.request import Request

EncoderCost = Callable[[Request, int], int]
"""``(request, piece) -> the prefill-token cost of encoding that piece of its images now`` (0: nothing
to encode), the model runner's ``ImageEncoder.pending_cost``; the scheduler's default (a text model)
is :func:`no_encoder`."""

PieceAhead = tuple[int, int]
"""``(tokens from a chunk's start to the piece's first placeholder in it, the piece's encoder
cost)``."""


def no_encoder(request: Request, piece: int) -> int:
    """The :data:`EncoderCost` of a model without a vision encoder: 0."""
    return 0


def pieces_ahead(request: Request, num_computed: int, limit: int,
                 encoder_cost: EncoderCost) -> list[PieceAhead]:
    """The pieces of ``request``'s images that a prefill chunk from ``num_computed`` of at most
    ``limit`` tokens would reach and that still need the encoder, in prompt order, as
    :data:`PieceAhead` s (a piece begun before ``num_computed``, whose placeholders a prefix-cache hit
    partly covers: its first placeholder at or after it)."""
    images = request.images
    if images is None or num_computed >= request.num_prompt_tokens or limit <= 0:
        return []
    out = []
    for piece in images.pieces_in(num_computed, limit):
        cost = encoder_cost(request, piece)
        if cost > 0:
            out.append((images.piece_first_at_or_after(piece, num_computed) - num_computed, cost))
    return out


def charged(pieces: list[PieceAhead], num_new: int) -> int:
    """The encoder cost a chunk of ``num_new`` tokens pays: that of the pieces it reaches."""
    return sum(cost for at, cost in pieces if at < num_new)
