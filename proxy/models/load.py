"""Load the configured model for the engine: resolve its folder (:mod:`proxy.models.source`),
refuse what the paged engine cannot serve, pick device and dtype (:mod:`proxy.models.device`),
build it dense or packed (:mod:`proxy.models.quantize`; a GGUF's weights are read from the file by
:mod:`proxy.models.packed_load`, packed or dense), and read
its tokenizer, context length and end-of-sequence ids.

- The caller names the attention implementation (``from_pretrained(..., attn_implementation=...)``)
  and the architecture check run on the config before the weights load: the engine's loader
  (``proxy.engine.loading.load_engine_model``) passes its paged attention and its rules; this package
  never imports the engine.
- ``max_model_len``: ``settings.max_model_len`` or the config's ``max_position_embeddings``.
- ``eos_token_ids``: the generation config's ``eos_token_id`` (int or list) + the tokenizer's.
- Dense fp32 linears on the CPU compute calls of few rows (decode steps) as ``W @ x^T``
  (:mod:`proxy.quant.skinny`).
- Packed sibling projections (q/k/v, gate/up) run as one matmul each (:mod:`proxy.quant.fuse`).
- The linears are built for the kernels the caller chose (:class:`~proxy.quant.linear_kernels.LinearKernels`:
  the AMX int4 kernel or torch's; dense bf16 or fp32 copies of the packed linears for prompt tokens,
  :mod:`proxy.quant.dense_prefill`, or none).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from proxy.models.device import resolve_device_dtype
from proxy.models.loaded import LoadedModel, ModelLoadError
from proxy.models.packed_load import load_gguf_dense, load_gguf_packed
from proxy.models.quantize import apply_quantization, gguf_packed
from proxy.models.source import mmproj_of, resolve_model_source
from proxy.models.vision import VisionProcessor, decoder_attention, is_served_vision, load_model_class
from proxy.quant.apply import add_dense_weights, use_prompt_tiles
from proxy.quant.fuse import fuse_sibling_linears
from proxy.quant.linear_kernels import LinearKernels
from proxy.quant.skinny import use_skinny_linears
from proxy.settings import Settings

logger = logging.getLogger(__name__)


def eos_ids_of(model: Any, tokenizer: Any) -> frozenset[int]:
    """EOS ids from the generation config (int or list) and the tokenizer."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos is not None:
        ids.update(int(e) for e in eos)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int):
        ids.add(tok_eos)
    return frozenset(ids)


def _build(settings: Settings, folder: Any, config: Any, gguf: Any, device: torch.device,
           dtype: torch.dtype, attn: str, kernels: LinearKernels) -> tuple[Any, str]:
    """The model, dense or packed, its linears built for ``kernels`` -> ``(model, quantization)``."""
    from transformers import AutoModelForCausalLM

    dense_dtype = kernels.dense_prefill
    mmproj = mmproj_of(settings)  # a vision-language model's vision tower, as llama.cpp ships it
    if gguf_packed(settings, gguf, device):
        model, quantization = load_gguf_packed(folder, config, gguf, device, dtype, attn, dense_dtype, mmproj)
    elif gguf is not None:  # its weights are in the file only (proxy.models.source)
        model = load_gguf_dense(folder, config, gguf, device, dtype, attn, mmproj)
        quantization = apply_quantization(model, settings, gguf, device)
    else:
        auto = load_model_class(config) if is_served_vision(config) else AutoModelForCausalLM
        attention = decoder_attention(config, attn)  # a vision tower keeps SDPA
        model = auto.from_pretrained(str(folder), dtype=dtype, attn_implementation=attention)
        model.to(device)  # type: ignore[arg-type]
        model.eval()
        quantization = apply_quantization(model, settings, gguf, device)
    skinny = use_skinny_linears(model)
    if skinny:
        logger.info("%d dense fp32 CPU linears compute calls of few rows as W @ x^T", skinny)
    fused = fuse_sibling_linears(model)
    if fused:
        logger.info("fused %d groups of packed sibling projections (q/k/v, gate/up), one matmul each", fused)
    if kernels.prompt_tiles and dense_dtype is None:
        num_tiles = use_prompt_tiles(model)
        if num_tiles:
            logger.info("prompt tokens run through the AMX prompt-row kernel in %d packed linears", num_tiles)
    if dense_dtype is not None:
        num_dense = add_dense_weights(model, dense_dtype)
        if num_dense:
            logger.info("prompt tokens run through dense %s copies of %d packed linears",
                        str(dense_dtype).removeprefix("torch."), num_dense)
    return model, quantization


def load_model(
    settings: Settings, *, attn_implementation: str, check_config: Callable[[Any], None],
    kernels: LinearKernels,
) -> LoadedModel:
    """Load the configured model (every rule: this module's docstring and the modules of its steps).

    Args:
        settings: the model, device, dtype, quantization and context options.
        attn_implementation: passed to ``from_pretrained`` (registered with transformers already).
        check_config: called with the ``AutoConfig`` before any weight loads; raises
            ``ModelLoadError`` to refuse the model.
        kernels: the kernels the linears are built for (the execution plan's part for loaders).

    Raises:
        ModelLoadError: not found, not convertible, or refused by ``check_config``.
    """
    from transformers import AutoConfig, AutoTokenizer

    start = time.monotonic()
    if settings.num_threads is not None:
        torch.set_num_threads(settings.num_threads)
    folder, default_name, gguf = resolve_model_source(settings)
    config = AutoConfig.from_pretrained(str(folder))
    check_config(config)
    device, dtype = resolve_device_dtype(settings)
    attn = attn_implementation
    logger.info("loading %s (%s, %s)", folder, device, dtype)
    with kernels.building():
        model, quantization = _build(settings, folder, config, gguf, device, dtype, attn, kernels)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    max_len = settings.max_model_len or getattr(text, "max_position_embeddings", None)
    if not max_len:
        raise ModelLoadError("max_model_len is not set and the model config has no max_position_embeddings")
    loaded = LoadedModel(
        model=model,
        hf_tokenizer=tokenizer,
        model_path=str(folder),
        served_model_name=settings.served_model_name or default_name,
        max_model_len=int(max_len),
        eos_token_ids=eos_ids_of(model, tokenizer),
        device=device,
        dtype=dtype,
        quantization=quantization,
        gguf_path=str(gguf) if gguf is not None else None,
        vision=VisionProcessor.load(folder, config),
    )
    logger.info(
        "loaded %s in %.2f s: %s, quantization %s, max_model_len=%d eos=%s",
        loaded.served_model_name, time.monotonic() - start, str(dtype).removeprefix("torch."), quantization,
        loaded.max_model_len, sorted(loaded.eos_token_ids),
    )
    return loaded
