"""Paged attention for any transformers decoder, registered through ``AttentionInterface``.

One module a concept:

- ``binding``: how transformers reaches us (the registered name, the metadata keyword,
  :func:`active_metadata` for layers that drop keyword arguments);
- ``cache``: the per-layer K/V block pools (:class:`PagedKVCache`, :class:`LayerSpec`);
- ``metadata``: one step's :class:`PagedAttentionMetadata` (slots, gathers, masks) and the key
  padding (:data:`KEY_PAD`) that makes attention batch invariant;
- ``kernels``: gather a context from a pool, attend over it (SDPA or the explicit soft-cap / sinks
  softmax), and the op that attends decode rows over the pools directly (compiled decode steps);
- ``probe``: the 3-token pass that measures every layer before the cache is sized;
- ``forward``: :func:`paged_attention_forward` itself (write K/V, attend decode rows and prefill
  chunks) and :func:`register`.
"""

from __future__ import annotations

from proxy.engine.execution.attention.binding import ATTN_IMPLEMENTATION, METADATA_KWARG, active_metadata
from proxy.engine.execution.attention.cache import (
    KVPoolSize,
    LayerSpec,
    PagedKVCache,
    activation_dtype,
    choose_num_blocks,
    cpu_pool_size,
    lazy_zeros,
)
from proxy.engine.execution.attention.forward import paged_attention_forward, register
from proxy.engine.execution.attention.metadata import KEY_PAD, PagedAttentionMetadata, padded_key_length
from proxy.engine.execution.attention.probe import LayerProbe, probe_layers

__all__ = [
    "ATTN_IMPLEMENTATION",
    "KEY_PAD",
    "METADATA_KWARG",
    "KVPoolSize",
    "LayerProbe",
    "LayerSpec",
    "PagedAttentionMetadata",
    "PagedKVCache",
    "activation_dtype",
    "active_metadata",
    "choose_num_blocks",
    "cpu_pool_size",
    "lazy_zeros",
    "padded_key_length",
    "paged_attention_forward",
    "probe_layers",
    "register",
]
