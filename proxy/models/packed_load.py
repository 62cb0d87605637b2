"""The low-memory loads of a GGUF (issues 14 and 46): the model skeleton on the ``meta`` device,
each linear packed straight from the GGUF's blocks (:func:`load_gguf_packed`) or, served dense,
dequantized (:func:`load_gguf_dense`), every other weight dequantized from the file one tensor at a
time (:mod:`proxy.models.gguf_weights`); no dense copy of a packed linear ever exists, and no
converted copy of the weights is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from proxy.models.gguf_weights import GGUFWeights, PairWeights, gguf_weights
from proxy.models.loaded import ModelLoadError
from proxy.models.mmproj import MMPROJ_MIN_BLOCKS, PROJECTORS, read_mmproj, row_processor
from proxy.models.quantize import one_thread
from proxy.models.vision import decoder_attention, is_served_vision, load_model_class
from proxy.quant import describe, load_gguf_linears
from proxy.quant import kernel_dtype as quant_kernel_dtype
from proxy.quant.gguf_rows import WeightSource


def load_gguf_packed(
    folder: Path, config: Any, gguf: Path, device: torch.device, dtype: torch.dtype, attn: str,
    dense_dtype: torch.dtype | None = None, mmproj: Path | None = None,
) -> tuple[Any, str]:
    """Build the model with its linears packed from the GGUF's own blocks, never holding a dense
    copy of a packed linear (issue 14: the dense-then-pack path peaked at 1.2 GB RSS for the default
    model).

    The skeleton is built by transformers on the ``meta`` device (:func:`_skeleton`). Each linear is
    packed from its GGUF tensor, matched against a few rows of its dense values as transformers
    dequantizes them (:func:`proxy.quant.load_gguf_linears` over
    :func:`proxy.models.gguf_weights.gguf_weights`); every parameter still on ``meta`` afterwards
    (embedding, norms, linears kept dense) is then dequantized from the file, one tensor at a
    time, cast to ``dtype`` as ``from_pretrained`` casts it. ``folder`` holds the config, tokenizer
    and generation config only. The served weights equal the dense-then-pack path's bit for bit
    (tests/test_models.py). ``dense_dtype``: the packed
    linears' dense prefill copies are made while packing (``proxy.quant.load_gguf_linears``).
    ``mmproj``: a vision-language model's vision tower and projector, read from that file dense
    (:func:`weight_source`); only the text GGUF's linears are packed.

    Returns:
        ``(model in eval mode, quantization description)``.
    Raises:
        ModelLoadError: a weight is missing from the file.
    """
    model, aliases = _skeleton(folder, config, dtype, attn)
    weights, vision = weight_source(gguf, mmproj, model, dtype, device, aliases)
    with one_thread():
        counts = load_gguf_linears(model, gguf, quant_kernel_dtype(device), weights, device, dense_dtype,
                                   skip=vision)
    _fill(model, weights, device)
    return model, "gguf: " + describe(counts)


def load_gguf_dense(
    folder: Path, config: Any, gguf: Path, device: torch.device, dtype: torch.dtype, attn: str,
    mmproj: Path | None = None,
) -> Any:
    """The model with every weight dequantized from the GGUF (``--quantization none/int8/int4``, or
    ``auto`` where the packed kernels are slow), as ``from_pretrained(gguf_file=...)`` would load it,
    without a converted folder: the skeleton of :func:`load_gguf_packed`, each parameter
    dequantized from the file in turn (:func:`weight_source`; with ``mmproj``, a vision-language
    model's vision tower and projector from that file).

    Raises:
        ModelLoadError: a weight is missing from the file.
    """
    model, aliases = _skeleton(folder, config, dtype, attn)
    _fill(model, weight_source(gguf, mmproj, model, dtype, device, aliases)[0], device)
    return model


def weight_source(gguf: Path, mmproj: Path | None, model: Any, dtype: torch.dtype, device: torch.device,
                  aliases: dict[str, str]) -> tuple[WeightSource, tuple[str, ...]]:
    """``(the weights of model's parameters, the module prefixes read from the mmproj)``: the text
    GGUF's (:func:`proxy.models.gguf_weights.gguf_weights`), or with ``mmproj`` a
    :class:`~proxy.models.gguf_weights.PairWeights` reading the projector's vision modules
    (``proxy.models.mmproj.PROJECTORS``) from the mmproj (gguf-py's ``MMPROJ`` names, as stored).

    Raises:
        ModelLoadError: the text GGUF's tensors are rearranged whole by transformers (not read by rows:
            no pair), or the mmproj is refused (``proxy.models.mmproj.read_mmproj``).
    """
    if mmproj is None:
        return gguf_weights(gguf, model, dtype, device, aliases), ()
    meta = read_mmproj(mmproj)
    text = GGUFWeights(gguf, model, dtype, device, aliases)
    # gguf-py numbers a projector's layers (mm.{bid}: LLaVA's linear_1 / linear_2) by block too
    blocks = max(int(meta.get("vision.block_count")), MMPROJ_MIN_BLOCKS)
    vision = GGUFWeights(mmproj, model, dtype, device, num_blocks=blocks, processor=row_processor(meta))
    modules = PROJECTORS[meta.projector].vision_modules
    return PairWeights(text, vision, modules), modules


def _skeleton(folder: Path, config: Any, dtype: torch.dtype, attn: str) -> tuple[Any, dict[str, str]]:
    """The model on ``meta`` (parameters only; buffers such as RoPE's ``inv_freq`` are real:
    ``accelerate.init_empty_weights(include_buffers=False)``, as ``from_pretrained`` does), the
    folder's generation config, and the aliases of a tied lm_head (-> the embedding's weight)."""
    from accelerate import init_empty_weights  # type: ignore[import-untyped]
    from transformers import AutoModelForCausalLM, GenerationConfig

    # a vision-language model's own class (its vision tower on SDPA); from_config is the Auto classes'
    vlm = is_served_vision(config)
    build = load_model_class(config)._from_config if vlm else AutoModelForCausalLM.from_config
    with init_empty_weights(include_buffers=False):
        model = build(config, dtype=dtype, attn_implementation=decoder_attention(config, attn))
    try:
        model.generation_config = GenerationConfig.from_pretrained(str(folder))
    except OSError:
        pass  # no generation_config.json: the one from_config derived stays
    names = {id(m): n for n, m in model.named_modules()}
    aliases = {}
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = out is not None and inp is not None and (
        out.weight is inp.weight or getattr(text, "tie_word_embeddings", False)
    )
    if tied:
        aliases[f"{names[id(out)]}.weight"] = f"{names[id(inp)]}.weight"
    return model, aliases


def _fill(model: Any, weights: WeightSource, device: torch.device) -> None:
    """Every parameter still on ``meta`` read whole from ``weights`` (a tied lm_head re-tied to the
    embedding read); the buffers moved to ``device``; eval mode.

    Raises:
        ModelLoadError: a buffer was not initialized, or a weight is missing.
    """
    for name, param in list(model.named_parameters()):
        if param.is_meta:
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            module._parameters[attr] = torch.nn.Parameter(weights.full(name), requires_grad=False)
    if any(p.is_meta for p in model.parameters()):
        model.tie_weights()  # a tied lm_head still holds the embedding's meta weight
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.is_meta:
            raise ModelLoadError(f"weight {name!r} was not loaded")
    for name, buf in model.named_buffers():
        if buf.is_meta:
            raise ModelLoadError(f"buffer {name!r} was not initialized")
    model.to(device)  # the buffers (the parameters are there already)
    model.eval()
