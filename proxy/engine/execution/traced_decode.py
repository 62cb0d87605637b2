"""The function the compiled decode step traces (:mod:`proxy.engine.execution.compiled_step`): one pure-decode
forward of the model over the paged KV cache, from the step's metadata tensors to logits. What it
builds is what the graph holds: the step's :class:`PagedAttentionMetadata` (decode rows through the
pools op where its C++ kernel is loaded) and the hint that every pool has one slot count."""

from __future__ import annotations

import torch

from proxy.engine.execution.attention import METADATA_KWARG, PagedAttentionMetadata, PagedKVCache
from proxy.engine.execution.attention.kernels import paged_decode_kernel_available


def decode_forward(
    model: torch.nn.Module,
    kv_cache: PagedKVCache,
    num_groups: int,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    slot_mapping: torch.Tensor,
    decode_gather: torch.Tensor,
    context_lens: torch.Tensor,
    decode_mask: torch.Tensor,
) -> torch.Tensor:
    """The function that is compiled: one pure-decode forward -> logits ``[B, V]`` (model dtype).

    Args:
        input_ids, position_ids: ``[1, B]`` int64; slot_mapping, context_lens ``[B]`` int64;
        decode_gather: ``[B, L]`` int64; decode_mask: ``[B, 1, 1, L]`` bool (True = a real key);
        the metadata fields of :class:`PagedAttentionMetadata`.
    """
    _one_slot_count(kv_cache)
    meta = PagedAttentionMetadata(
        kv_cache=kv_cache, slot_mapping=slot_mapping, num_decodes=input_ids.shape[1],
        decode_gather=decode_gather, decode_context_lens=context_lens, decode_mask=decode_mask,
        num_groups=num_groups, paged_decode=paged_decode_kernel_available(),
    )
    out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=0,
                **{METADATA_KWARG: meta})
    logits: torch.Tensor = out.logits[0]
    return logits


def _one_slot_count(kv_cache: PagedKVCache) -> None:
    """Tell the tracer that every pool has the first one's slot count (``torch._check``), so the
    graph takes one size symbol for all of them instead of one per pool: inductor's C++ wrapper
    turns each size argument into a tensor at every call (60 pools: ~60 ``torch.tensor`` calls a
    step). Pools of different counts (none among the models the compiled step serves) are left
    alone."""
    pools = (*kv_cache.key_pools, *kv_cache.value_pools)
    if not pools:
        return
    count = pools[0].shape[0]
    if all(p.shape[0] == count for p in pools):
        for pool in pools[1:]:
            torch._check(pool.shape[0] == count)
