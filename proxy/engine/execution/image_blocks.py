"""Bidirectional attention within an image during prefill, for a model that asks for it (Gemma 3:
``proxy.models.vision.BIDIRECTIONAL_IMAGES``).

transformers' Gemma 3 prefill marks the image placeholder tokens with ``token_type_ids`` and groups
each run of consecutive ones into a block (``get_block_sequence_ids_for_mask``); a query in a block
also sees every key of that block, later ones included (``create_masks_for_vision_model``: full
layers ``OR(causal, block)``, sliding layers ``AND(window, OR(causal, block))``); a block sees no
later block, and decode steps are plain causal (``prepare_inputs_for_generation`` drops
``token_type_ids`` after the first forward). Here the same blocks are
``proxy.media.prompt.PromptImages.blocks``, and :func:`add_prefill_image_blocks` hands a step's
block ids to its attention metadata (``PagedAttentionMetadata.add_image_blocks``), which ORs them
into every prefill mask; steps without such rows build nothing.

A block's first rows need its last keys in the same step: the scheduler never ends a prompt chunk
inside a block (``Scheduler.whole_image_blocks``). A prefix-cache hit may end inside one: the rows it
covers were computed whole, in the step that computed their block, and the cache keys a block
holding image tokens by the images' content hashes (``PromptImages.block_extra``), so they hold the
same values; the rest of the block runs in one chunk that sees them causally. (That key names the
images with a placeholder in the KV block; ``Gemma3Processor`` wraps every image in
``<start_of_image>`` ... ``<end_of_image>``, so an image block is one image's soft tokens and no
other image's content reaches its rows.) Decode rows (one token,
never inside a block but at its last token) need nothing.
"""

from __future__ import annotations

import torch

from proxy.engine.execution.attention import PagedAttentionMetadata
from proxy.engine.execution.step_inputs import StepRows


def add_prefill_image_blocks(meta: PagedAttentionMetadata, rows: StepRows) -> bool:
    """Give the prefill rows of ``rows`` whose chunk holds image placeholder tokens their image
    blocks (``meta.add_image_blocks``): key ``k`` of prefill row ``i`` takes the index of the
    request's block holding position ``k`` where that block meets the row's chunk and ``k`` is in
    the row's context (-1 elsewhere), each query the id of its position. ``meta``: built from
    ``rows`` (``build_step_inputs``), on the CPU.

    Returns:
        whether any row had such a block (False: ``meta`` unchanged).
    """
    positions, gather = meta.prefill_positions, meta.prefill_gather
    if positions is None or gather is None:
        return False
    nd = rows.num_decodes
    key_blocks: torch.Tensor | None = None
    for i, (request, start, count) in enumerate(zip(rows.requests[nd:], rows.starts[nd:], rows.counts[nd:],
                                                    strict=True)):
        images = request.images
        if images is None or start >= request.num_prompt_tokens:
            continue
        end = start + count
        for k, (first, last) in enumerate(images.blocks):
            if first >= end:
                break
            if last >= start:
                if key_blocks is None:
                    key_blocks = torch.full(gather.shape, -1, dtype=torch.long)
                key_blocks[i, first: min(last + 1, end)] = k
    if key_blocks is None:
        return False
    meta.add_image_blocks(key_blocks.gather(1, positions), key_blocks)
    return True
