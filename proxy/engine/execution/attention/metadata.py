"""One step's attention metadata (:class:`PagedAttentionMetadata`) and the key padding that makes
attention batch invariant (:data:`KEY_PAD`, :func:`padded_key_length`).

The masks follow transformers' eager attention and mask functions (``masking_utils``):

- sliding window ``W`` (Mistral, Gemma 2/3, GPT-OSS, OLMo 3, Cohere 2, ...): query at position
  ``p`` sees keys ``k`` with ``p - W < k <= p``; a window at least as long as the context is full
  attention and costs nothing (no extra mask is built while every context fits the window);
- chunked attention of size ``C`` (Llama 4): keys with ``k // C == p // C`` and ``k <= p``;
- image blocks (Gemma 3's prefill): a prefill query in an image block also sees the later keys of
  that block, before the window applies (:meth:`PagedAttentionMetadata.add_image_blocks`, set by
  ``proxy.engine.execution.image_blocks`` for the steps that hold such rows).

**Batch invariance.** The model runner pads every step's key length to a multiple of
:data:`KEY_PAD` (64) tokens, padding masked. A softmax row's reductions then cover the same vector
lanes whatever the other sequences of the step are: measured on torch 2.13's CPU kernels, a row's
output is the same bits alone or beside sequences of any length, for any number of query rows
(decode rows, prefill chunks on top of cached or prefix-cached tokens), in bf16 through SDPA and
the explicit path. With the key length left at the step's longest context, a row whose real keys
ended inside the kernel's vector tail summed in another order when a longer sequence joined the
step; at bf16 that changed greedy tokens (8 of 36 concurrent requests of the public cases: a
request's temperature-0 text depended on the load). The packed int4/int8 linears are row-invariant
too, so the default serving's T0 output does not depend on the batch. The compiled decode step's
attention op (``kernels.paged_decode_attention``) reads only a row's own keys, so its rows are
invariant whatever the padding. Not covered: fp32 dense
matmuls (a one-row product takes another kernel than a many-row one) and a few fp32 SDPA key
lengths; fp32 serving keeps differences at near-ties ("Defeating Nondeterminism in LLM
Inference", Thinking Machines, 2025, describes the same problem on GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from proxy.engine.execution.attention.cache import PagedKVCache

if TYPE_CHECKING:
    from proxy.quant.dense_prefill import RowPlan

KEY_PAD = 64
"""Every step's key length is padded to a multiple of this many tokens (:func:`padded_key_length`),
which makes attention batch invariant; see the module docstring."""


def padded_key_length(length: int) -> int:
    """The key length (tokens) of a step whose longest context is ``length`` tokens: the next
    multiple of :data:`KEY_PAD` (the model runner gathers that many slots per sequence, the padding
    masked)."""
    return -(-length // KEY_PAD) * KEY_PAD


def pattern_mask(
    keys: torch.Tensor, pos: torch.Tensor, window: int | None, chunk: int | None,
    same_block: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which keys a query sees: causal (``key <= pos``) or, where ``same_block`` is given, in the
    query's own image block (bool, True where query and key lie in one; bidirectional image
    attention), then within ``window`` tokens when set (sliding window: ``key > pos - window``) and
    in the query's own ``chunk`` when set (chunked attention: ``key // chunk == pos // chunk``), as
    transformers composes them (``create_masks_for_vision_model``: full layers ``OR(causal, block)``,
    sliding layers ``AND(window, OR(causal, block))``). ``keys`` and ``pos`` are int64 tensors that
    broadcast (keys ``[1, L]`` with pos ``[B, 1]``, or ``[1, 1, L]`` with ``[B, Q, 1]``;
    ``same_block`` broadcasts with them); returns the broadcast bool mask."""
    mask = keys <= pos
    if same_block is not None:
        mask = mask | same_block
    if window is not None:
        mask &= keys > pos - window
    if chunk is not None:
        mask &= torch.div(keys, chunk, rounding_mode="floor") == torch.div(pos, chunk, rounding_mode="floor")
    return mask


@dataclass
class PagedAttentionMetadata:
    """Everything the attention layers need for one ragged step; built once, shared by all layers.

    The step's ``T`` tokens are flat: the first ``num_decodes`` are the single query tokens of
    ``num_decodes`` decode rows, the rest are the prefill chunks of ``B_p`` sequences.

    Attributes:
        kv_cache: the pools.
        slot_mapping: ``[T]`` int64, the cache slot each new token's K/V is written to.
        num_decodes: decode rows ``B_d`` (their tokens are ``0 .. B_d - 1``).
        decode_gather: ``[B_d, L_d]`` int64 slots of each decode row's context (padding -> slot 0).
        decode_context_lens: ``[B_d]`` int64 context length of each decode row (its query is at
            position ``len - 1``).
        decode_mask: ``[B_d, 1, 1, L_d]`` bool, True where a key is real; None when none is padded.
        prefill_query_index: ``[B_p * Q_p]`` int64 flat token index of each padded prefill query.
        prefill_gather: ``[B_p, L_p]`` int64 slots of each prefill sequence's context.
        prefill_positions: ``[B_p, Q_p]`` int64 position of each padded query (padding repeats the
            row's last query).
        prefill_mask: ``[B_p, 1, G * Q_p, L_p]`` bool (GQA group ``G`` of the model's first layer
            folded, bottom-right causal).
        prefill_valid: ``[N_p]`` int64 indices into the padded ``B_p * Q_p`` queries that are real.
        prefill_token_index: ``[N_p]`` int64 flat token index of each real prefill query.
        num_prefill_seqs, prefill_query_len: ``B_p`` and ``Q_p``.
        num_groups: the ``G`` ``prefill_mask`` was folded with.
        masks: per-step cache of the masks of other patterns / groups (filled by the first layer
            that needs one).
        paged_decode: plain decode rows attend through ``kernels.paged_decode_attention`` over the
            pools (set by the compiled decode step where the C++ kernel is loaded), not a gather
            and SDPA.
        row_plan: which tokens the packed linears run through their dense copies (prompt tokens;
            :class:`proxy.quant.dense_prefill.RowPlan`), or None (all packed, or no packed layers).
        prefill_query_blocks: ``[B_p, Q_p]`` int64, the image block of each padded prefill query
            (-1: none), and prefill_key_blocks: ``[B_p, L_p]`` int64, of each key (-1: none or
            past the row's chunk); a query sees every key of its own block (:meth:`add_image_blocks`);
            None: no such row in the step.
    """

    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_gather: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    prefill_query_index: torch.Tensor | None = None
    prefill_gather: torch.Tensor | None = None
    prefill_positions: torch.Tensor | None = None
    prefill_mask: torch.Tensor | None = None
    prefill_valid: torch.Tensor | None = None
    prefill_token_index: torch.Tensor | None = None
    num_prefill_seqs: int = 0
    prefill_query_len: int = 0
    num_groups: int = 1
    masks: dict[tuple[Any, ...], torch.Tensor | None] = field(default_factory=dict)
    row_plan: RowPlan | None = None
    paged_decode: bool = False
    prefill_query_blocks: torch.Tensor | None = None
    prefill_key_blocks: torch.Tensor | None = None

    def decode_mask_for(self, window: int | None, chunk: int | None) -> torch.Tensor | None:
        """The decode key mask ``[B_d, 1, 1, L_d]`` (or None: all keys visible) of a pattern."""
        assert self.decode_gather is not None and self.decode_context_lens is not None
        max_len = self.decode_gather.shape[1]
        if (window is None or window >= max_len) and (chunk is None or chunk >= max_len):
            return self.decode_mask
        key = ("decode", window, chunk)
        if key not in self.masks:
            ctx = self.decode_context_lens
            keys = torch.arange(max_len, device=ctx.device)[None, :]
            mask = pattern_mask(keys, (ctx - 1)[:, None], window, chunk)
            self.masks[key] = mask.view(ctx.shape[0], 1, 1, max_len)
        return self.masks[key]

    def sdpa_mask(self, mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        """``mask`` (bool, True = visible) as SDPA's additive float mask (0 / -inf) in ``dtype``,
        converted once a step: SDPA converts a bool mask the same way in every call (``where``),
        30 times a step for one mask on SmolLM2-135M; the values, so the results, are identical."""
        if mask is None:
            return None
        key = ("sdpa", id(mask), dtype)  # the bool masks live in this metadata for the whole step
        cached = self.masks.get(key)
        if cached is None:
            cached = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            cached.masked_fill_(~mask, float("-inf"))
            self.masks[key] = cached
        return cached

    def prefill_mask_for(self, window: int | None, chunk: int | None, group: int) -> torch.Tensor:
        """The prefill mask ``[B_p, 1, group * Q_p, L_p]`` of a pattern and GQA group size."""
        assert self.prefill_gather is not None and self.prefill_positions is not None
        max_len = self.prefill_gather.shape[1]
        if window is not None and window >= max_len:
            window = None
        if chunk is not None and chunk >= max_len:
            chunk = None
        if window is None and chunk is None and group == self.num_groups:
            assert self.prefill_mask is not None
            return self.prefill_mask
        key = ("prefill", window, chunk, group)
        cached = self.masks.get(key)
        if cached is None:
            cached = self._prefill_pattern(window, chunk, group)
            self.masks[key] = cached
        return cached

    def _prefill_pattern(self, window: int | None, chunk: int | None, group: int) -> torch.Tensor:
        """:func:`pattern_mask` over the prefill queries and keys, image blocks included, folded
        over ``group``: ``[B_p, 1, group * Q_p, L_p]`` bool."""
        assert self.prefill_gather is not None and self.prefill_positions is not None
        max_len = self.prefill_gather.shape[1]
        pos = self.prefill_positions[:, :, None]  # [B_p, Q_p, 1]
        keys = torch.arange(max_len, device=pos.device)[None, None, :]
        same = None
        if self.prefill_query_blocks is not None and self.prefill_key_blocks is not None:
            q_block = self.prefill_query_blocks[:, :, None]
            same = (q_block == self.prefill_key_blocks[:, None, :]) & (q_block >= 0)  # [B_p, Q_p, L_p]
        mask = pattern_mask(keys, pos, window, chunk, same)
        b, q_len = self.prefill_positions.shape
        return mask[:, None].expand(b, group, q_len, max_len).reshape(b, 1, group * q_len, max_len)

    def add_image_blocks(self, query_blocks: torch.Tensor, key_blocks: torch.Tensor) -> None:
        """Let each prefill query see every key of its own image block, as a model with
        bidirectional image attention computes its prefill (Gemma 3's ``token_type_ids``;
        :func:`pattern_mask`): ``query_blocks [B_p, Q_p]`` and ``key_blocks [B_p, L_p]`` int64 block
        ids (-1: in none; a key past its row's chunk must be -1, its slot is not written), on the
        prefill tensors' device. Rebuilds :attr:`prefill_mask`; call before any layer reads a mask.
        The scheduler keeps each block whole in one chunk (``Scheduler.whole_image_blocks``)."""
        self.prefill_query_blocks = query_blocks
        self.prefill_key_blocks = key_blocks
        self.masks.clear()
        self.prefill_mask = self._prefill_pattern(None, None, self.num_groups)
