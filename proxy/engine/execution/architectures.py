"""Which transformers architectures the paged engine serves exactly, and why the others are refused.

Two gates, both before the server reports ready:

1. :func:`check_config` (through :func:`check_supported`, before the weights load):
   refusals decided by the config alone -- layers whose state lives outside the KV cache (Mamba,
   linear attention, short convolutions: ``STATEFUL``), attention kinds the paged cache does not
   implement (indexer-based sparse attention, ``layer_types`` such as ``indexed_attention``),
   architectures that bypass transformers' ``AttentionInterface`` (``REFUSED``), bidirectional and
   encoder-decoder models.
2. :func:`layer_specs` (called by the model runner after a probe pass, see
   ``attention.probe_layers``): every decoder layer must call the attention function exactly once
   with its own ``layer_idx`` and grouped-query head counts; the per-layer shapes, windows,
   chunk sizes, soft-caps and sinks measured there become the cache's :class:`LayerSpec` list.

Served (and checked token by token against ``generate()`` in
``tests/engine/execution/test_architectures.py``): full, sliding-window (per layer, ``layer_types``)
and chunked (Llama 4) attention, soft-capping (Gemma 2), attention sinks (GPT-OSS), multi-head latent
attention (DeepSeek V2/V3, GLM-4.7-Flash).
The load-time self-check (``proxy.engine.selfcheck``) catches what these rules do not foresee.
"""

from __future__ import annotations

from typing import Any

from proxy.engine.execution.attention import LayerProbe, LayerSpec
from proxy.models.loaded import ModelLoadError

STATEFUL_REASON = (
    "has Mamba / linear-attention / recurrent layers whose state lives outside the KV cache, which "
    "streamproxy's paged engine does not keep"
)
TRY_ELSEWHERE = "serve it with vLLM or llama.cpp, or pick a pure-attention model"

STATEFUL: frozenset[str] = frozenset({
    "mamba", "mamba2", "falcon_mamba", "jamba", "bamba", "zamba", "zamba2", "falcon_h1",
    "granitemoehybrid", "nemotron_h", "lfm2", "lfm2_moe", "qwen3_next", "qwen3_5", "qwen3_5_text",
    "qwen3_5_moe", "qwen3_5_moe_text", "minimax", "kimi_linear", "olmo_hybrid", "recurrent_gemma",
    "rwkv", "xlstm",
})
"""Model types refused up front: per-sequence state that is not K/V (wrong text if served)."""

REFUSED: dict[str, str] = {
    "falcon": (
        "implements its own attention classes instead of transformers' AttentionInterface, so the "
        "paged KV cache cannot be plugged in"
    ),
    "deepseek_v32": (
        "uses DeepSeek sparse attention, whose indexer reads a dense attention mask that the paged "
        "engine does not build"
    ),
}
"""Model types refused up front for another reason (the reason names what is unsupported)."""

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
"""``layer_types`` entries served (transformers' names)."""
MLP_LAYER_TYPES = frozenset({"dense", "sparse", "moe"})
"""``layer_types`` entries that describe the MLP, not attention (checked by the probe instead)."""
STATEFUL_LAYER_TYPES = frozenset({"linear_attention", "mamba", "mamba2", "conv", "hybrid", "hybrid_sliding",
                                  "recurrent"})

UNDERSTOOD_KWARGS = frozenset({
    "sliding_window", "softcap", "s_aux", "position_ids", "cache_position", "output_attentions",
    "use_cache", "position_embeddings", "output_router_logits",
})
"""Keyword arguments a layer may pass to the attention function; others are reported by the probe."""


class UnsupportedArchitectureError(ValueError):
    """The model cannot be served exactly; the message names the model type, what is unsupported
    and what to try."""


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if get is not None else config


def _refuse(model_type: str, what: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(f"model type '{model_type}' {what}; {TRY_ELSEWHERE}")


def check_config(config: Any) -> None:
    """Refuse, before loading weights, what the config alone shows cannot be served exactly.

    Raises:
        UnsupportedArchitectureError: see the module docstring for the rules.
    """
    text = _text_config(config)
    model_type = str(getattr(text, "model_type", None) or getattr(config, "model_type", "unknown"))
    for mt in {model_type, str(getattr(config, "model_type", ""))}:
        if mt in STATEFUL:
            raise _refuse(mt, STATEFUL_REASON)
        if mt in REFUSED:
            raise _refuse(mt, REFUSED[mt])
    if getattr(config, "is_encoder_decoder", False):
        raise _refuse(model_type, "is an encoder-decoder model; only decoder-only models are served")
    if getattr(text, "use_bidirectional_attention", False):
        raise _refuse(
            model_type, "uses bidirectional attention (an encoder); only causal decoders are served"
        )
    layer_types = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None) or []
    kinds = {str(t) for t in layer_types}
    stateful = kinds & STATEFUL_LAYER_TYPES
    if stateful:
        raise _refuse(model_type, f"{STATEFUL_REASON} (layer types {sorted(stateful)})")
    unknown = kinds - ATTENTION_LAYER_TYPES - MLP_LAYER_TYPES
    if unknown:
        raise _refuse(
            model_type,
            f"has attention layers of kind {sorted(unknown)}, which the paged engine does not implement",
        )
    if "chunked_attention" in kinds and not getattr(text, "attention_chunk_size", None):
        raise _refuse(model_type, "has chunked-attention layers but no attention_chunk_size")
    if "sliding_attention" in kinds and not getattr(text, "sliding_window", None):
        raise _refuse(model_type, "has sliding-attention layers but no sliding_window")


def check_supported(config: Any) -> None:
    """Refuse architectures the paged engine cannot serve exactly (the rules of :func:`check_config`).

    Raises:
        proxy.models.ModelLoadError: with the rule's reason (model type, what is unsupported, what to
            try).
    """
    try:
        check_config(config)
        _check_causal_lm_class(config)
    except UnsupportedArchitectureError as exc:
        raise ModelLoadError(str(exc)) from exc


def _check_causal_lm_class(config: Any) -> None:
    """Refuse a config that ``AutoModelForCausalLM`` has no class for (a vision-language model such as
    ``qwen2_vl``, an encoder), in one line naming its type, before transformers' own ``ValueError``
    that lists every config class it knows; a config with remote code (``auto_map``) is left to it."""
    from transformers import PretrainedConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if not isinstance(config, PretrainedConfig) or getattr(config, "auto_map", None):
        return
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise _refuse(str(getattr(config, "model_type", "unknown")),
                      "has no causal language model class in transformers (vision-language and encoder "
                      "models are not served)")


def layer_specs(config: Any, probe: LayerProbe) -> list[LayerSpec]:
    """The cache's per-layer specs from a probe pass, with the config's windows and chunk sizes.

    A layer whose ``layer_types`` entry is ``sliding_attention`` but that passed no
    ``sliding_window`` gets the config's; ``chunked_attention`` layers get ``attention_chunk_size``.

    Raises:
        UnsupportedArchitectureError: a decoder layer did not call the attention function (state
            outside the KV cache), called it twice, without ``layer_idx``, or with heads that do
            not form grouped-query attention.
    """
    text = _text_config(config)
    model_type = str(getattr(text, "model_type", None) or getattr(config, "model_type", "unknown"))
    if probe.errors:
        raise _refuse(model_type, f"cannot run on the paged KV cache: {probe.errors[0]}")
    num_layers = int(getattr(text, "num_hidden_layers", 0) or len(probe.calls))
    missing = sorted(set(range(num_layers)) - set(probe.calls))
    if missing or not probe.calls:
        raise _refuse(
            model_type,
            f"has decoder layers that do not use the attention function (layers {missing[:8]} of "
            f"{num_layers}): {STATEFUL_REASON}",
        )
    extra = sorted(set(probe.calls) - set(range(num_layers)))
    if extra:
        raise _refuse(model_type, f"has attention layers {extra[:8]} beyond num_hidden_layers={num_layers}")
    layer_types = list(getattr(text, "layer_types", None) or [])
    specs = []
    for i in range(num_layers):
        spec, _names = probe.calls[i]
        kind = layer_types[i] if i < len(layer_types) else "full_attention"
        window = spec.sliding_window
        if window is None and kind == "sliding_attention":
            window = int(text.sliding_window)
        chunk = int(text.attention_chunk_size) if kind == "chunked_attention" else None
        specs.append(LayerSpec(
            num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, key_dim=spec.key_dim,
            value_dim=spec.value_dim, sliding_window=window, chunk_size=chunk, softcap=spec.softcap,
            has_sinks=spec.has_sinks,
        ))
    return specs


def unexpected_kwargs(probe: LayerProbe) -> list[str]:
    """Names of keyword arguments layers passed that the attention function does not interpret."""
    names: set[str] = set()
    for _spec, passed in probe.calls.values():
        names.update(n for n in passed if n not in UNDERSTOOD_KWARGS)
    return sorted(names)
