"""The paged attention function that transformers calls in every layer (``AttentionInterface``).

The model code is never copied: :func:`register` adds :func:`paged_attention_forward` under the name
``ATTN_IMPLEMENTATION``; a model loaded (or switched) with ``attn_implementation=ATTN_IMPLEMENTATION``
calls it in every layer with RoPE already applied. transformers has no mask function for this name,
so it passes ``attention_mask=None`` and this package owns all masking (``metadata``).

Per layer the function (1) writes the step's new K/V into the layer's pool at ``slot_mapping``
(vLLM's PagedAttention layout: one flat pool of ``num_blocks * block_size`` slots), then
(2) attends. Decode rows (one query token each) are batched: one gather of every sequence's
context to a padded ``[B, H_kv, L_max, D]`` tensor and one ``scaled_dot_product_attention`` with
the GQA group folded into the query dimension and a key mask; no Python loop over requests.
Where ``meta.paged_decode`` is set (the compiled decode step, with the C++ kernel loaded), plain
decode rows instead attend over the pools directly (``kernels.paged_decode_attention``: no gather,
no padding, fp32 softmax). Prefill chunks are batched the same way with padded queries and a
bottom-right-aligned causal mask (a chunk on top of cached tokens sees all of them).

Per-layer variants, each read from what the layer passes (and its config), as transformers' eager
attention and mask functions define them: sliding windows and chunked attention (masks, see
``metadata``), attention logit soft-capping (Gemma 2) and attention sinks (GPT-OSS ``s_aux``,
sinks ``[H]``; see ``kernels``), and K and V of their own widths (multi-head latent attention; see
``cache``).
"""

from __future__ import annotations

from typing import Any

import torch

from proxy.engine.execution.attention import kernels
from proxy.engine.execution.attention.binding import ATTN_IMPLEMENTATION, METADATA_KWARG, current_metadata
from proxy.engine.execution.attention.probe import LayerProbe, record_probe


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
        query: ``[1, H, T, Dk]`` (RoPE applied).
        key: ``[1, H_kv, T, Dk]``, value ``[1, H_kv, T, Dv]`` of the step's new tokens (GQA heads
            not expanded).
        attention_mask: ignored (None: no mask function is registered for our name).
        scaling: softmax scale; None = ``Dk ** -0.5``.
        kwargs: ``paged_attn_metadata`` (or the metadata published by :func:`active_metadata`);
            the layer's ``sliding_window``, ``softcap`` and ``s_aux`` (sinks ``[H]``) when it has them.

    Returns:
        ``([1, T, H, Dv], None)``.

    Raises:
        RuntimeError: called without metadata (e.g. ``generate()`` on a model switched to this
            implementation).
    """
    meta = current_metadata(kwargs)
    if meta is None:
        raise RuntimeError(
            f"{ATTN_IMPLEMENTATION} attention needs the {METADATA_KWARG} keyword (it runs only inside "
            "the streamproxy engine); switch the model to 'eager' or 'sdpa' for generate()"
        )
    if isinstance(meta, LayerProbe):
        return record_probe(meta, module, query, key, value, scaling, kwargs)
    cache = meta.kv_cache
    layer: int = module.layer_idx  # type: ignore[assignment]
    spec = cache.layers[layer]
    k_pool = cache.key_pools[layer]
    v_pool = cache.value_pools[layer]
    _, num_heads, num_tokens, _ = query.shape
    num_kv_heads = key.shape[1]
    value_dim = value.shape[-1]
    group = num_heads // num_kv_heads
    window = kwargs.get("sliding_window")
    if window is None:
        window = spec.sliding_window
    chunk = spec.chunk_size
    softcap = kwargs.get("softcap")
    s_aux = kwargs.get("s_aux")
    sinks = None
    plain = softcap is None and s_aux is None  # SDPA, which takes the step's additive mask
    # [1, H_kv, T, D] -> [T, H_kv, D], written at the step's slots.
    k_pool.index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1).to(k_pool.dtype))
    v_pool.index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1).to(v_pool.dtype))

    q_flat = query[0].transpose(0, 1)  # [T, H, Dk] (a view)
    num_decodes = meta.num_decodes
    decode_out = None
    if num_decodes:
        gather = meta.decode_gather
        assert gather is not None and meta.decode_context_lens is not None
        over_pools = (meta.paged_decode and plain and window is None and chunk is None
                      and k_pool.dtype == v_pool.dtype == query.dtype)
        if over_pools:
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            decode_out = kernels.paged_decode_attention(q_flat[:num_decodes], k_pool, v_pool, gather,
                                                        meta.decode_context_lens, scale)
        else:
            # [B_d, L_d, H_kv, D] -> [B_d, H_kv, L_d, D]
            k = kernels.gather(k_pool, gather).transpose(1, 2)
            v = kernels.gather(v_pool, gather).transpose(1, 2)
            q = q_flat[:num_decodes].reshape(num_decodes, num_kv_heads, group, q_flat.shape[-1])
            if s_aux is not None:
                sinks = s_aux.view(num_kv_heads, group, 1)
            mask = meta.decode_mask_for(window, chunk)
            if plain:
                mask = meta.sdpa_mask(mask, q.dtype)
            decode_out = kernels.attend(q, k, v, mask, scaling, softcap, sinks)
            decode_out = decode_out.reshape(num_decodes, num_heads, value_dim)
        if num_decodes == num_tokens:
            return decode_out.unsqueeze(0), None

    out = torch.empty((num_tokens, num_heads, value_dim), dtype=query.dtype, device=query.device)
    if decode_out is not None:
        out[:num_decodes] = decode_out
    num_seqs, q_len = meta.num_prefill_seqs, meta.prefill_query_len
    assert meta.prefill_gather is not None and meta.prefill_query_index is not None
    k = kernels.gather(k_pool, meta.prefill_gather).transpose(1, 2)  # [B_p, H_kv, L_p, D]
    v = kernels.gather(v_pool, meta.prefill_gather).transpose(1, 2)
    q = q_flat.index_select(0, meta.prefill_query_index)  # [B_p * Q_p, H, Dk]
    # fold the GQA group into the query dim: [B_p, H_kv, G * Q_p, Dk], row g * Q_p + j
    q = q.view(num_seqs, q_len, num_kv_heads, group, -1).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_seqs, num_kv_heads, group * q_len, -1)
    if s_aux is not None:
        sinks = s_aux.view(num_kv_heads, group, 1).expand(num_kv_heads, group, q_len)
        sinks = sinks.reshape(num_kv_heads, group * q_len, 1)
    mask = meta.prefill_mask_for(window, chunk, group)
    if plain:
        mask = meta.sdpa_mask(mask, q.dtype)
    prefill_out = kernels.attend(q, k, v, mask, scaling, softcap, sinks)
    # back to [B_p * Q_p, H, Dv]
    prefill_out = prefill_out.view(num_seqs, num_kv_heads, group, q_len, value_dim).permute(0, 3, 1, 2, 4)
    prefill_out = prefill_out.reshape(num_seqs * q_len, num_heads, value_dim)
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
