"""Paged attention for any transformers decoder, registered through ``AttentionInterface``.

The model code is never copied: ``register()`` adds :func:`paged_attention_forward` under the name
``ATTN_IMPLEMENTATION``; a model loaded (or switched) with ``attn_implementation=ATTN_IMPLEMENTATION``
calls it in every layer with RoPE already applied. transformers has no mask function for this name,
so it passes ``attention_mask=None`` and this module owns all masking. The per-step
:class:`PagedAttentionMetadata` reaches every layer as the extra keyword ``paged_attn_metadata``
given to ``model(...)``.

Per layer the function (1) writes the step's new K/V into the layer's pool at ``slot_mapping``
(vLLM's PagedAttention layout: one flat pool of ``num_blocks * block_size`` slots), then
(2) attends. Decode rows (one query token each) are batched: one gather of every sequence's
context to a padded ``[B, H_kv, L_max, D]`` tensor and one ``scaled_dot_product_attention`` with
the GQA group folded into the query dimension and a key-padding mask; no Python loop over requests.
Prefill chunks are batched the same way with padded queries and a bottom-right-aligned causal mask
(a chunk on top of cached tokens sees all of them). Sliding-window layers, logit soft-capping and
attention sinks are refused with an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "streamproxy_paged"
"""The name our attention function is registered under in transformers' ``AttentionInterface``."""

METADATA_KWARG = "paged_attn_metadata"
"""The keyword of ``model(...)`` that carries the step's :class:`PagedAttentionMetadata`."""


class PagedKVCache:
    """Per-layer K and V block pools.

    Each pool is a tensor ``[num_blocks * block_size, num_kv_heads, head_dim]`` of ``dtype`` on
    ``device``; slot ``block * block_size + offset`` holds one position. Create it outside
    ``torch.inference_mode()`` (writes inside inference mode then work in place).

    Args:
        num_layers, num_kv_heads, head_dim: from the model config.
        num_blocks, block_size: pool geometry.
        dtype, device: of the model's activations.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.key_pools = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value_pools = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """KV cache bytes one token occupies across all layers (K and V)."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def num_bytes(self) -> int:
        """Total bytes of all pools."""
        return self.num_blocks * self.block_size * self.bytes_per_token(
            self.num_layers, self.num_kv_heads, self.head_dim, self.dtype
        )


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
        decode_mask: ``[B_d, 1, 1, L_d]`` bool, True where a key is real; None when none is padded.
        prefill_query_index: ``[B_p * Q_p]`` int64 flat token index of each padded prefill query.
        prefill_gather: ``[B_p, L_p]`` int64 slots of each prefill sequence's context.
        prefill_mask: ``[B_p, 1, G * Q_p, L_p]`` bool (GQA group folded, bottom-right causal).
        prefill_valid: ``[N_p]`` int64 indices into the padded ``B_p * Q_p`` queries that are real.
        prefill_token_index: ``[N_p]`` int64 flat token index of each real prefill query.
        num_prefill_seqs, prefill_query_len: ``B_p`` and ``Q_p``.
    """

    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_gather: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    prefill_query_index: torch.Tensor | None = None
    prefill_gather: torch.Tensor | None = None
    prefill_mask: torch.Tensor | None = None
    prefill_valid: torch.Tensor | None = None
    prefill_token_index: torch.Tensor | None = None
    num_prefill_seqs: int = 0
    prefill_query_len: int = 0


def _gather(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``pool[slots]`` for a pool ``[S, H_kv, D]`` and slots ``[B, L]`` -> ``[B, L, H_kv, D]``.

    ``index_select`` on the flattened slots is the same result as advanced indexing and measured
    4.3x faster on CPU (53 vs 230 us for 16 x 110 slots, 3 heads, D=64, 2 threads): ~10 ms of a
    170 ms decode step at 16 sequences on SmolLM2-135M.
    """
    return pool.index_select(0, slots.reshape(-1)).view(*slots.shape, *pool.shape[1:])


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over the paged KV cache (transformers ``AttentionInterface`` signature).

    Args:
        module: the attention module; ``module.layer_idx`` selects the layer's pools.
        query: ``[1, H, T, D]`` (RoPE applied).
        key, value: ``[1, H_kv, T, D]`` of the step's new tokens (GQA heads not expanded).
        attention_mask: ignored (None: no mask function is registered for our name).
        scaling: softmax scale; None = ``D ** -0.5``.
        kwargs: must hold ``paged_attn_metadata``.

    Returns:
        ``([1, T, H, D], None)``.

    Raises:
        RuntimeError: called without metadata (e.g. ``generate()`` on a model switched to this
            implementation), or for a sliding-window / soft-capped / attention-sink layer.
    """
    meta: PagedAttentionMetadata | None = kwargs.get(METADATA_KWARG)
    if meta is None:
        raise RuntimeError(
            f"{ATTN_IMPLEMENTATION} attention needs the {METADATA_KWARG} keyword (it runs only inside "
            "the streamproxy engine); switch the model to 'sdpa' for generate()"
        )
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None or "s_aux" in kwargs:
        raise RuntimeError("sliding-window, soft-capped and attention-sink layers are not supported")
    cache = meta.kv_cache
    layer: int = module.layer_idx  # type: ignore[assignment]
    k_pool = cache.key_pools[layer]
    v_pool = cache.value_pools[layer]
    _, num_heads, num_tokens, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    # [1, H_kv, T, D] -> [T, H_kv, D], written at the step's slots.
    k_pool.index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1).to(k_pool.dtype))
    v_pool.index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1).to(v_pool.dtype))

    q_flat = query[0].transpose(0, 1)  # [T, H, D] (a view)
    num_decodes = meta.num_decodes
    decode_out = None
    if num_decodes:
        gather = meta.decode_gather
        assert gather is not None
        # [B_d, L_d, H_kv, D] -> [B_d, H_kv, L_d, D]
        k = _gather(k_pool, gather).transpose(1, 2)
        v = _gather(v_pool, gather).transpose(1, 2)
        q = q_flat[:num_decodes].reshape(num_decodes, num_kv_heads, group, head_dim)
        decode_out = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_mask, scale=scaling)
        decode_out = decode_out.reshape(num_decodes, num_heads, head_dim)
        if num_decodes == num_tokens:
            return decode_out.unsqueeze(0), None

    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if decode_out is not None:
        out[:num_decodes] = decode_out
    num_seqs, q_len = meta.num_prefill_seqs, meta.prefill_query_len
    assert meta.prefill_gather is not None and meta.prefill_query_index is not None
    k = _gather(k_pool, meta.prefill_gather).transpose(1, 2)  # [B_p, H_kv, L_p, D]
    v = _gather(v_pool, meta.prefill_gather).transpose(1, 2)
    q = q_flat.index_select(0, meta.prefill_query_index)  # [B_p * Q_p, H, D]
    # fold the GQA group into the query dim: [B_p, H_kv, G * Q_p, D], row g * Q_p + j
    q = q.view(num_seqs, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_seqs, num_kv_heads, group * q_len, head_dim)
    prefill_out = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.prefill_mask, scale=scaling)
    # back to [B_p * Q_p, H, D]
    prefill_out = prefill_out.view(num_seqs, num_kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)
    prefill_out = prefill_out.reshape(num_seqs * q_len, num_heads, head_dim)
    if meta.prefill_valid is None:
        out[num_decodes:] = prefill_out
    else:
        assert meta.prefill_token_index is not None
        out.index_copy_(0, meta.prefill_token_index, prefill_out.index_select(0, meta.prefill_valid))
    return out.unsqueeze(0), None


def register() -> str:
    """Register :func:`paged_attention_forward` with transformers (idempotent).

    Returns:
        the implementation name to pass as ``attn_implementation``.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
