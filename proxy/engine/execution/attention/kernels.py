"""The tensor kernels of paged attention: gather a context from a pool and attend over it, or (the
op :data:`paged_decode_attention`, decode rows of the compiled decode step) attend over the pools
directly.

Plain layers go to ``scaled_dot_product_attention``. Soft-capped layers (Gemma 2: attention logit
soft-capping ``c``, ``scores = c * tanh(scores / c)`` before the mask) and sink layers (GPT-OSS
``s_aux``: one extra logit per head joins the softmax and is dropped) use an explicit
``softmax(q k^T)``: SDPA cannot express either.

Query rows are padded so that no block of torch's CPU flash-attention kernel holds one or two rows
(:func:`query_rows_padded`): the kernel splits the rows of a call into blocks of 32 (64 from 192
rows, 256 from 768), and a block of one row (bf16 and fp32) or two rows (fp32) takes another GEMM
path, whose bits differ from the same row's in a larger block. Measured on torch 2.13, 2-core
AVX-512 VM: bf16, 1% of the rows of real SmolLM2-135M activations came out different alone and as
row 33 of 33; fp32, every row of a 1- or 2-row tail. A prompt chunked into 11 tokens (33 rows with
3-way GQA) then got other tokens than the same prompt in one chunk (the public case C09).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from proxy.quant.kernels import cpp_kernels_loaded, define_cpu_op


def gather(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``pool[slots]`` for a pool ``[S, H_kv, D]`` and slots ``[B, L]`` -> ``[B, L, H_kv, D]``.

    ``index_select`` on the flattened slots is the same result as advanced indexing and measured
    4.3x faster on CPU (53 vs 230 us for 16 x 110 slots, 3 heads, D=64, 2 threads): ~10 ms of a
    170 ms decode step at 16 sequences on SmolLM2-135M.
    """
    return pool.index_select(0, slots.reshape(-1)).view(*slots.shape, *pool.shape[1:])


#: the CPU flash-attention kernel's smallest row block (its blocks are 32, 64 or 256 rows).
QUERY_BLOCK = 32
#: rows to add for a row count ``r`` by ``r % QUERY_BLOCK``: tails of 1 or 2 rows become 3.
_ROW_PAD = {1: 2, 2: 1}


def query_rows_padded(rows: int) -> int:
    """The row count an attention call of ``rows`` query rows runs with: ``rows`` unless its last
    block of :data:`QUERY_BLOCK` would hold one or two rows, then up to a tail of three (a tail of
    1-2 rows mod 32 is also the only way to one of 1-2 rows mod 64 or 256)."""
    return rows + _ROW_PAD.get(rows % QUERY_BLOCK, 0)


def _repeat_last_row(t: torch.Tensor, pad: int) -> torch.Tensor:
    """``t [..., R, X]`` with its last row repeated ``pad`` times -> ``[..., R + pad, X]``."""
    return torch.cat([t, t[..., -1:, :].expand(*t.shape[:-2], pad, t.shape[-1])], dim=-2)


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
    ``PagedAttentionMetadata.sdpa_mask``) for plain layers; ``[..., R or 1, L]``.

    A row's output is the same bits whatever ``R`` and whatever the other rows: the rows are padded
    to :func:`query_rows_padded` (copies of the last row, dropped from the result; module docstring).
    """
    rows = q.shape[-2]
    pad = query_rows_padded(rows) - rows
    if pad:
        q = _repeat_last_row(q, pad)
        if mask is not None and mask.shape[-2] == rows:
            mask = _repeat_last_row(mask, pad)
        if sinks is not None and sinks.shape[-2] == rows:
            sinks = _repeat_last_row(sinks, pad)
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
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
        out = torch.matmul(probs.to(v.dtype), v)
    return out[..., :rows, :].contiguous() if pad else out


def _paged_decode_attention_reference(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The op's math in torch (its Python kernel where ``proxy.quant._torch_ops`` is not loaded, and
    the tests' reference): fp32 scores over each row's first ``context_lens[b]`` slots, fp32
    softmax and sum, rounded once to the query's dtype. Same values as the C++ kernel up to fp32
    summation order."""
    rows, heads, dk = query.shape
    heads_kv = key_pool.shape[1]
    group = heads // heads_kv
    keys = slots.shape[1]
    k = gather(key_pool, slots).float().transpose(1, 2)  # [B, H_kv, L, Dk]
    v = gather(value_pool, slots).float().transpose(1, 2)
    q = query.float().reshape(rows, heads_kv, group, dk)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H_kv, G, L]
    visible = torch.arange(keys)[None, :] < context_lens[:, None]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [B, H_kv, G, Dv]
    return out.reshape(rows, heads, -1).to(query.dtype)


def _paged_decode_attention_fake(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                                 *_: object) -> torch.Tensor:
    """The op's output for tracing: ``[B, H, Dv]`` in the query's dtype."""
    return query.new_empty((query.shape[0], query.shape[1], value_pool.shape[2]))


define_cpu_op(
    "paged_decode_attention(Tensor query, Tensor key_pool, Tensor value_pool, Tensor slots, "
    "Tensor context_lens, float scale) -> Tensor",
    _paged_decode_attention_reference, _paged_decode_attention_fake,
)

#: ``streamproxy::paged_decode_attention`` (``ext/kernels/torch_ops.cpp``): decode rows attend over
#: the paged pools directly, ``query [B, H, Dk]``, ``key_pool [S, H_kv, Dk]``, ``value_pool [S, H_kv,
#: Dv]``, ``slots [B, L]`` and ``context_lens [B]`` int64, ``scale`` -> ``[B, H, Dv]``; a row reads its
#: own ``context_lens[b]`` keys only (batch invariant by construction), fp32 softmax.
paged_decode_attention = torch.ops.streamproxy.paged_decode_attention.default


def paged_decode_kernel_available() -> bool:
    """Whether decode rows can attend through the C++ :data:`paged_decode_attention` (the compiled
    decode step uses it then; the Python kernel would take the GIL inside the graph)."""
    return cpp_kernels_loaded()
