"""Swap a loaded model's ``nn.Linear`` modules for :class:`PackedLinear` (the model code is untouched).

Embeddings and norms are never touched (they are not ``nn.Linear``). The lm_head is quantized
like every other linear; a tied lm_head is untied first (the embedding keeps its dense weight).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from proxy.quant import amx_int4
from proxy.quant.embedding import GROUP_SIZE
from proxy.quant.int8_linear import Int8Linear, kernel_available
from proxy.quant.linear import Int4Plane, PackedLinear, quantize_int4, quantize_int8, quantize_int8_codes
from proxy.quant.skinny import SkinnyLinear

logger = logging.getLogger(__name__)

#: ``--quantization`` methods that quantize at load from the float weights.
FLOAT_METHODS: dict[str, Callable[[torch.Tensor, int], list[Int4Plane]]] = {
    "int4": quantize_int4,
    "int8": quantize_int8,
}


def named_linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """``(qualified name, module)`` of every dense linear, ``nn.Linear`` or
    :class:`~proxy.quant.skinny.SkinnyLinear` (a snapshot list, safe to replace while iterating)."""
    return iter([(n, m) for n, m in model.named_modules() if type(m) in (nn.Linear, SkinnyLinear)])


_LIBC: Any = None


def trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim(0)``; a no-op elsewhere).

    Packing a layer frees transient copies (int32 codes, planes) of a few MB each that glibc keeps
    in its arenas; trimmed after each layer, the default model's load peaked at 823-829 MB RSS,
    untrimmed at 856-1131 MB (same code, run to run; bench/rss_bench.py)."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 (glibc only)
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule at dotted ``name``."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def output_layer(model: nn.Module) -> Any:
    """The model's output layer (``get_output_embeddings()``), or None where it has none."""
    get_out = getattr(model, "get_output_embeddings", None)
    return get_out() if callable(get_out) else None


def add_dense_weights(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Give every packed linear except the output layer a dense copy for prompt rows, computed in
    ``dtype`` (``proxy.quant.dense_prefill.dense_weight_dtype``): the kernel's dequantized bf16
    weight, kept in bf16 (``PackedLinear.set_dense_weight`` widens it per call for fp32).

    Returns:
        the number of layers given one (0 when the model has no packed linears).
    """
    out = output_layer(model)
    count = 0
    for module in model.modules():
        if type(module) is PackedLinear and module is not out and module.kernel_dtype == torch.bfloat16:
            if module.dense_weight is None or module.dense_dtype != dtype:  # none from its planes
                module.set_dense_weight(module.dequantize(), dtype)
            count += 1
    return count


def use_prompt_tiles(model: nn.Module) -> int:
    """Make every AMX packed linear (int4: ``PackedLinear`` on the AMX variant, int8: ``Int8Linear``)
    except the output layer compute a step's prompt tokens through its kernel's prompt-row variant
    (``prompt_tiles``; where the execution plan chose it: ``LinearKernels.prompt_tiles``). Returns how
    many layers take it."""
    out = output_layer(model)
    count = 0
    for module in model.modules():
        int4 = (type(module) is PackedLinear and module.amx and module.dense_weight is None
                and amx_int4.amx_available())  # the AVX2 variant has no prompt-row kernel
        if module is not out and (int4 or (type(module) is Int8Linear and module.amx)):
            setattr(module, "prompt_tiles", True)  # noqa: B010 - PackedLinear's or Int8Linear's
            count += 1
    return count


def untie_lm_head(model: nn.Module) -> None:
    """Give a tied output layer its own module so that swapping it leaves the embedding dense."""
    out = output_layer(model)
    get_in = getattr(model, "get_input_embeddings", None)
    inp = get_in() if callable(get_in) else None
    if out is not None and inp is not None and out.weight is inp.weight:
        out.weight = nn.Parameter(inp.weight.detach().clone(), requires_grad=False)
        if hasattr(model.config, "tie_word_embeddings"):
            model.config.tie_word_embeddings = False


def replace_linear(
    model: nn.Module,
    name: str,
    planes: list[Int4Plane],
    group_size: int,
    kernel_dtype: torch.dtype,
    scheme: str,
    device: torch.device | None = None,
    bias: torch.Tensor | None = None,
    dense_dtype: torch.dtype | None = None,
) -> bool:
    """Replace linear ``name`` by a :class:`PackedLinear` of ``planes``; False (kept dense, logged at
    debug level) where the kernel cannot take the shape. ``dense_dtype``: also give it the dense copy
    :func:`add_dense_weights` would (computed from the planes, :func:`proxy.quant.linear.kernel_view`).

    ``device`` / ``bias``: where to pack and the bias to keep, by default the old module's weight
    device and bias (given explicitly when the old module sits on the ``meta`` device)."""
    old = model.get_submodule(name)
    weight, old_bias = old.weight, old.bias
    assert isinstance(weight, torch.Tensor) and (old_bias is None or isinstance(old_bias, torch.Tensor))
    bias = old_bias if bias is None else bias
    try:
        new = PackedLinear(planes, bias, group_size, device or weight.device, kernel_dtype, scheme,
                           dense_dtype)
    except ValueError as exc:
        logger.debug("%s stays dense: %s", name, exc)
        return False
    set_module(model, name, new)
    return True


def quantize_linears(
    model: nn.Module, method: str, group_size: int, kernel_dtype: torch.dtype,
    keep_dense: frozenset[str] = frozenset(),
) -> Counter[str]:
    """Quantize every ``nn.Linear`` of ``model`` in place from its float weight, except those named
    in ``keep_dense``.

    Args:
        method: ``"int4"`` (asymmetric groups) or ``"int8"`` (symmetric groups, two int4 planes;
            an :class:`~proxy.quant.int8_linear.Int8Linear` on a CPU that runs the ``Q8_0`` kernel
            when ``group_size`` is its 32).
        group_size: input features per scale (32 by default).
        keep_dense: qualified names of linears left as they are (a vision-language model's vision
            encoder: ``proxy.models.vision.encoder_linears``), counted as ``"dense (kept)"``.
    Returns:
        counts: ``{"int4 g32": n, "dense": m}`` (modules kept dense: shapes the kernel refuses).
    Raises:
        ValueError: unknown ``method``.
    """
    if method not in FLOAT_METHODS:
        raise ValueError(f"unknown quantization {method!r}")
    untie_lm_head(model)
    counts: Counter[str] = Counter()
    q8_kernel = method == "int8" and group_size == GROUP_SIZE and kernel_available()
    for name, linear in named_linears(model):
        if name in keep_dense:
            counts["dense (kept)"] += 1
            continue
        if q8_kernel and linear.weight.device.type == "cpu" and linear.in_features % group_size == 0:
            codes, scales = quantize_int8_codes(linear.weight, group_size)  # through the Q8_0 kernel
            set_module(model, name, Int8Linear(codes, scales, linear.bias, f"int8 g{group_size}"))
            counts[f"int8 g{group_size}"] += 1
            continue
        planes = (
            FLOAT_METHODS[method](linear.weight, group_size) if linear.in_features % group_size == 0 else None
        )
        ok = planes is not None and replace_linear(model, name, planes, group_size, kernel_dtype,
                                                   f"{method} g{group_size}")
        counts[f"{method} g{group_size}" if ok else "dense"] += 1
    return counts


def describe(counts: Counter[str]) -> str:
    """``"int4 g32 x210, dense x1"``: what is served, for the log and /v1/models."""
    return (
        ", ".join(f"{k} x{v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))) or "dense"
    )
