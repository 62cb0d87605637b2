"""Paged attention for any transformers decoder, registered through ``AttentionInterface``.

The model code is never copied: ``register()`` adds :func:`paged_attention_forward` under the name
``ATTN_IMPLEMENTATION``; a model loaded (or switched) with ``attn_implementation=ATTN_IMPLEMENTATION``
calls it in every layer with RoPE already applied. transformers has no mask function for this name,
so it passes ``attention_mask=None`` and this module owns all masking. The per-step
:class:`PagedAttentionMetadata` reaches every layer as the extra keyword ``paged_attn_metadata``
given to ``model(...)``; for decoder layers that do not pass keyword arguments on to their
attention (StableLM), the model runner also publishes it for the duration of the forward pass
(:func:`active_metadata`), so the function finds it either way.

Per layer the function (1) writes the step's new K/V into the layer's pool at ``slot_mapping``
(vLLM's PagedAttention layout: one flat pool of ``num_blocks * block_size`` slots), then
(2) attends. Decode rows (one query token each) are batched: one gather of every sequence's
context to a padded ``[B, H_kv, L_max, D]`` tensor and one ``scaled_dot_product_attention`` with
the GQA group folded into the query dimension and a key mask; no Python loop over requests.
Prefill chunks are batched the same way with padded queries and a bottom-right-aligned causal mask
(a chunk on top of cached tokens sees all of them).

Per-layer variants, each read from what the layer passes (and its config), as transformers' eager
attention and mask functions define them (``masking_utils``):

- sliding window ``W`` (Mistral, Gemma 2/3, GPT-OSS, OLMo 3, Cohere 2, ...): query at position
  ``p`` sees keys ``k`` with ``p - W < k <= p``; a window at least as long as the context is full
  attention and costs nothing (no extra mask is built while every context fits the window);
- chunked attention of size ``C`` (Llama 4): keys with ``k // C == p // C`` and ``k <= p``;
- attention logit soft-capping ``c`` (Gemma 2): ``scores = c * tanh(scores / c)`` before the mask;
- attention sinks (GPT-OSS ``s_aux``): one extra logit per head joins the softmax and is dropped;
- K and V of their own widths (multi-head latent attention of DeepSeek V2/V3: K is
  ``qk_nope_head_dim + qk_rope_head_dim`` wide, V ``v_head_dim``): each layer's pools have the
  shapes the layer really produces (:class:`LayerSpec`, measured by :func:`probe_layers`).

Soft-capped and sink layers use an explicit ``softmax(q k^T)`` (SDPA cannot express either); all
other layers use ``scaled_dot_product_attention``.

**Batch invariance.** The model runner pads every step's key length to a multiple of
:data:`KEY_PAD` (64) tokens, padding masked. A softmax row's reductions then cover the same vector
lanes whatever the other sequences of the step are: measured on torch 2.13's CPU kernels, a row's
output is the same bits alone or beside sequences of any length, for any number of query rows
(decode rows, prefill chunks on top of cached or prefix-cached tokens), in bf16 through SDPA and
the explicit path. With the key length left at the step's longest context, a row whose real keys
ended inside the kernel's vector tail summed in another order when a longer sequence joined the
step; at bf16 that changed greedy tokens (8 of 36 concurrent requests of the public cases: a
request's temperature-0 text depended on the load). The packed int4/int8 linears are row-invariant
too, so the default serving's T0 output does not depend on the batch. Not covered: fp32 dense
matmuls (a one-row product takes another kernel than a many-row one) and a few fp32 SDPA key
lengths; fp32 serving keeps differences at near-ties ("Defeating Nondeterminism in LLM
Inference", Thinking Machines, 2025, describes the same problem on GPUs).
"""

from __future__ import annotations

import math
import mmap
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "streamproxy_paged"
"""The name our attention function is registered under in transformers' ``AttentionInterface``."""

METADATA_KWARG = "paged_attn_metadata"
"""The keyword of ``model(...)`` that carries the step's :class:`PagedAttentionMetadata`."""

_ACTIVE = threading.local()


@contextmanager
def active_metadata(meta: Any) -> Iterator[None]:
    """Publish ``meta`` to :func:`paged_attention_forward` calls of this thread while the block runs.

    For decoder layers that drop the keyword arguments of ``model(...)`` before calling their
    attention (transformers' StableLM). Outside the block the function still refuses to run.
    """
    previous = getattr(_ACTIVE, "meta", None)
    _ACTIVE.meta = meta
    try:
        yield
    finally:
        _ACTIVE.meta = previous


@dataclass(frozen=True)
class LayerSpec:
    """What one attention layer needs from the cache and the mask (measured by :func:`probe_layers`).

    Attributes:
        num_heads: query heads ``H``.
        num_kv_heads: K/V heads ``H_kv`` (``H`` for MLA, which expands its latent per head).
        key_dim, value_dim: K and V head widths (equal except for multi-head latent attention).
        sliding_window: ``W`` in tokens, or None (full attention).
        chunk_size: ``C`` in tokens for chunked attention (Llama 4), or None.
        softcap: attention logit soft-cap (Gemma 2), or None.
        has_sinks: the layer passes attention sinks (GPT-OSS ``s_aux``).
    """

    num_heads: int
    num_kv_heads: int
    key_dim: int
    value_dim: int
    sliding_window: int | None = None
    chunk_size: int | None = None
    softcap: float | None = None
    has_sinks: bool = False

    @property
    def pattern(self) -> tuple[int | None, int | None]:
        """``(sliding_window, chunk_size)``: layers with the same pattern share their masks."""
        return (self.sliding_window, self.chunk_size)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(shape, dtype)`` whose pages become resident only once written, on the CPU.

    CPU: an anonymous ``mmap`` (the kernel zero-fills each page on first touch), so the KV cache's
    RSS grows with the blocks used instead of the whole ``kv_cache_bytes`` at startup
    (``torch.zeros`` writes every page: 1 GiB of the default server's 1.9 GB peak RSS, issue 14).
    Elsewhere: ``torch.zeros``.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # the tensor keeps a reference to it
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


class PagedKVCache:
    """Per-layer K and V block pools, each of its layer's own shape.

    Layer ``i`` has a K pool ``[num_blocks * block_size, H_kv_i, key_dim_i]`` and a V pool
    ``[num_blocks * block_size, H_kv_i, value_dim_i]`` of ``dtype`` on ``device``; slot
    ``block * block_size + offset`` holds one position. Create it outside ``torch.inference_mode()``
    (writes inside inference mode then work in place).

    Args:
        layers: one :class:`LayerSpec` per layer, in ``layer_idx`` order.
        num_blocks, block_size: pool geometry.
        dtype, device: of the model's activations.
    """

    def __init__(
        self,
        layers: list[LayerSpec],
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.layers = list(layers)
        self.num_layers = len(layers)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        slots = num_blocks * block_size
        self.key_pools = [lazy_zeros((slots, s.num_kv_heads, s.key_dim), dtype, self.device) for s in layers]
        self.value_pools = [
            lazy_zeros((slots, s.num_kv_heads, s.value_dim), dtype, self.device) for s in layers
        ]

    @staticmethod
    def bytes_per_token(layers: list[LayerSpec], dtype: torch.dtype) -> int:
        """KV cache bytes one token occupies across all layers (K and V, each of its own width)."""
        size = torch.empty((), dtype=dtype).element_size()
        return sum(s.num_kv_heads * (s.key_dim + s.value_dim) for s in layers) * size

    @property
    def num_bytes(self) -> int:
        """Total bytes of all pools."""
        return self.num_blocks * self.block_size * self.bytes_per_token(self.layers, self.dtype)


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
            pos = (ctx - 1)[:, None]
            mask = keys <= pos
            if window is not None:
                mask &= keys > pos - window
            if chunk is not None:
                mask &= torch.div(keys, chunk, rounding_mode="floor") == torch.div(
                    pos, chunk, rounding_mode="floor"
                )
            self.masks[key] = mask.view(ctx.shape[0], 1, 1, max_len)
        return self.masks[key]

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
            pos = self.prefill_positions[:, :, None]  # [B_p, Q_p, 1]
            keys = torch.arange(max_len, device=pos.device)[None, None, :]
            mask = keys <= pos
            if window is not None:
                mask &= keys > pos - window
            if chunk is not None:
                mask &= torch.div(keys, chunk, rounding_mode="floor") == torch.div(
                    pos, chunk, rounding_mode="floor"
                )
            b, q_len = self.prefill_positions.shape
            cached = mask[:, None].expand(b, group, q_len, max_len).reshape(b, 1, group * q_len, max_len)
            self.masks[key] = cached
        return cached


KEY_PAD = 64
"""Every step's key length is padded to a multiple of this many tokens (:func:`padded_key_length`),
which makes attention batch invariant; see the module docstring."""


def padded_key_length(length: int) -> int:
    """The key length (tokens) of a step whose longest context is ``length`` tokens: the next
    multiple of :data:`KEY_PAD` (the model runner gathers that many slots per sequence, the padding
    masked)."""
    return -(-length // KEY_PAD) * KEY_PAD


def _gather(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``pool[slots]`` for a pool ``[S, H_kv, D]`` and slots ``[B, L]`` -> ``[B, L, H_kv, D]``.

    ``index_select`` on the flattened slots is the same result as advanced indexing and measured
    4.3x faster on CPU (53 vs 230 us for 16 x 110 slots, 3 heads, D=64, 2 threads): ~10 ms of a
    170 ms decode step at 16 sequences on SmolLM2-135M.
    """
    return pool.index_select(0, slots.reshape(-1)).view(*slots.shape, *pool.shape[1:])


def _attend(
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


@dataclass
class LayerProbe:
    """Metadata of a probe pass (:func:`probe_layers`): each attention call records its layer here.

    Attributes:
        calls: ``layer_idx -> (LayerSpec, names of the non-None keyword arguments)`` in call order.
        errors: what could not be recorded (e.g. a module without ``layer_idx``).
    """

    calls: dict[int, tuple[LayerSpec, tuple[str, ...]]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    num_calls: int = 0


def _record_probe(
    probe: LayerProbe,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """Record one layer's shapes and arguments; return plain causal attention of the probe tokens."""
    probe.num_calls += 1
    layer = getattr(module, "layer_idx", None)
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    spec = LayerSpec(
        num_heads=query.shape[1],
        num_kv_heads=key.shape[1],
        key_dim=key.shape[-1],
        value_dim=value.shape[-1],
        sliding_window=int(window) if window is not None else None,
        softcap=float(softcap) if softcap is not None else None,
        has_sinks=kwargs.get("s_aux") is not None,
    )
    names = tuple(sorted(k for k, v in kwargs.items() if v is not None and k != METADATA_KWARG))
    if not isinstance(layer, int):
        probe.errors.append(f"an attention module ({type(module).__name__}) has no integer layer_idx")
    elif layer in probe.calls:
        probe.errors.append(f"layer {layer} called the attention function twice in one forward pass")
    else:
        probe.calls[layer] = (spec, names)
    if key.shape[1] != value.shape[1] or query.shape[1] % key.shape[1]:
        probe.errors.append(
            f"layer {layer}: {query.shape[1]} query heads, {key.shape[1]} key heads and {value.shape[1]} "
            "value heads do not form grouped-query attention"
        )
        out = torch.zeros((*query.shape[:-1], value.shape[-1]), dtype=query.dtype, device=query.device)
        return out.transpose(1, 2), None
    group = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(group, dim=1)
    v = value.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling)
    return out.transpose(1, 2), None


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
    meta = kwargs.get(METADATA_KWARG)
    if meta is None:
        meta = getattr(_ACTIVE, "meta", None)
    if meta is None:
        raise RuntimeError(
            f"{ATTN_IMPLEMENTATION} attention needs the {METADATA_KWARG} keyword (it runs only inside "
            "the streamproxy engine); switch the model to 'eager' or 'sdpa' for generate()"
        )
    if isinstance(meta, LayerProbe):
        return _record_probe(meta, module, query, key, value, scaling, kwargs)
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
    # [1, H_kv, T, D] -> [T, H_kv, D], written at the step's slots.
    k_pool.index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1).to(k_pool.dtype))
    v_pool.index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1).to(v_pool.dtype))

    q_flat = query[0].transpose(0, 1)  # [T, H, Dk] (a view)
    num_decodes = meta.num_decodes
    decode_out = None
    if num_decodes:
        gather = meta.decode_gather
        assert gather is not None
        # [B_d, L_d, H_kv, D] -> [B_d, H_kv, L_d, D]
        k = _gather(k_pool, gather).transpose(1, 2)
        v = _gather(v_pool, gather).transpose(1, 2)
        q = q_flat[:num_decodes].reshape(num_decodes, num_kv_heads, group, q_flat.shape[-1])
        if s_aux is not None:
            sinks = s_aux.view(num_kv_heads, group, 1)
        mask = meta.decode_mask_for(window, chunk)
        decode_out = _attend(q, k, v, mask, scaling, softcap, sinks)
        decode_out = decode_out.reshape(num_decodes, num_heads, value_dim)
        if num_decodes == num_tokens:
            return decode_out.unsqueeze(0), None

    out = torch.empty((num_tokens, num_heads, value_dim), dtype=query.dtype, device=query.device)
    if decode_out is not None:
        out[:num_decodes] = decode_out
    num_seqs, q_len = meta.num_prefill_seqs, meta.prefill_query_len
    assert meta.prefill_gather is not None and meta.prefill_query_index is not None
    k = _gather(k_pool, meta.prefill_gather).transpose(1, 2)  # [B_p, H_kv, L_p, D]
    v = _gather(v_pool, meta.prefill_gather).transpose(1, 2)
    q = q_flat.index_select(0, meta.prefill_query_index)  # [B_p * Q_p, H, Dk]
    # fold the GQA group into the query dim: [B_p, H_kv, G * Q_p, Dk], row g * Q_p + j
    q = q.view(num_seqs, q_len, num_kv_heads, group, -1).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_seqs, num_kv_heads, group * q_len, -1)
    if s_aux is not None:
        sinks = s_aux.view(num_kv_heads, group, 1).expand(num_kv_heads, group, q_len)
        sinks = sinks.reshape(num_kv_heads, group * q_len, 1)
    mask = meta.prefill_mask_for(window, chunk, group)
    prefill_out = _attend(q, k, v, mask, scaling, softcap, sinks)
    # back to [B_p * Q_p, H, Dv]
    prefill_out = prefill_out.view(num_seqs, num_kv_heads, group, q_len, value_dim).permute(0, 3, 1, 2, 4)
    prefill_out = prefill_out.reshape(num_seqs * q_len, num_heads, value_dim)
    if meta.prefill_valid is None:
        out[num_decodes:] = prefill_out
    else:
        assert meta.prefill_token_index is not None
        out.index_copy_(0, meta.prefill_token_index, prefill_out.index_select(0, meta.prefill_valid))
    return out.unsqueeze(0), None


def probe_layers(model: torch.nn.Module) -> LayerProbe:
    """Run a 3-token forward pass that records every attention layer (:class:`LayerProbe`).

    The model must use ``ATTN_IMPLEMENTATION``. Layers are measured as they really run (K/V heads
    and widths, sliding window, soft-cap, sinks): the cache is then sized from these shapes, not
    from config fields that multi-head latent attention or per-layer head dims do not follow.
    """
    probe = LayerProbe()
    param = next(model.parameters())
    input_ids = torch.tensor([[1, 2, 3]], device=param.device)
    position_ids = torch.arange(3, device=param.device).view(1, 3)
    with torch.inference_mode(), active_metadata(probe):
        model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=1,
              **{METADATA_KWARG: probe})
    return probe


def register() -> str:
    """Register :func:`paged_attention_forward` with transformers (idempotent).

    Returns:
        the implementation name to pass as ``attn_implementation``.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
