"""The probe pass: measure every attention layer as it really runs, before the cache is sized.

A 3-token forward pass with a :class:`LayerProbe` as the metadata: each call of the paged attention
function records its layer (K/V heads and widths, sliding window, soft-cap, sinks) instead of
touching a cache. The cache is then sized from these shapes, not from config fields that multi-head
latent attention or per-layer head dims do not follow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from proxy.engine.execution.attention.binding import METADATA_KWARG, active_metadata
from proxy.engine.execution.attention.cache import LayerSpec


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


def record_probe(
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
