"""The two tensor kernels of paged attention: gather a context from a pool, attend over it.

Plain layers go to ``scaled_dot_product_attention``. Soft-capped layers (Gemma 2: attention logit
soft-capping ``c``, ``scores = c * tanh(scores / c)`` before the mask) and sink layers (GPT-OSS
``s_aux``: one extra logit per head joins the softmax and is dropped) use an explicit
``softmax(q k^T)``: SDPA cannot express either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``pool[slots]`` for a pool ``[S, H_kv, D]`` and slots ``[B, L]`` -> ``[B, L, H_kv, D]``.

    ``index_select`` on the flattened slots is the same result as advanced indexing and measured
    4.3x faster on CPU (53 vs 230 us for 16 x 110 slots, 3 heads, D=64, 2 threads): ~10 ms of a
    170 ms decode step at 16 sequences on SmolLM2-135M.
    """
    return pool.index_select(0, slots.reshape(-1)).view(*slots.shape, *pool.shape[1:])


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` over ``q [B, H_kv, R, Dk]``, ``k [B, H_kv, L, Dk]``,
    ``v [B, H_kv, L, Dv]`` -> ``[B, H_kv, R, Dv]``.

    Plain layers go to ``scaled_dot_product_attention``. Soft-capping (Gemma 2, as transformers'
    eager attention: ``c * tanh(s / c)`` after scaling, before the mask) and sinks (GPT-OSS: a
    per-row logit ``sinks [H_kv, R, 1]`` joins the softmax, then is dropped) are computed
    explicitly, the softmax in float32.

    ``mask``: bool (True = visible) for every path, or SDPA's additive float mask (0 / -inf, from
    ``PagedAttentionMetadata.sdpa_mask``) for plain layers.
    """
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().unsqueeze(0).expand(scores.shape[0], -1, -1, -1)
        combined = torch.cat([scores, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.to(v.dtype), v)
