"""GGUF linear tensors at their own precision: each block type's values in a packed layer.

Block layouts (ggml ``ggml-common.h``; 32 weights a block, along the input dimension):

- ``Q4_0``: 18 bytes: ``d`` (fp16), 16 bytes of nibbles; weight ``j`` (0..15) is the low nibble
  of byte ``j``, weight ``j + 16`` its high nibble; value ``d * (q - 8)``.
- ``Q4_1``: 20 bytes: ``d``, ``m`` (fp16), 16 bytes of nibbles as above; value ``d * q + m``.
- ``Q8_0``: 34 bytes: ``d`` (fp16), 32 int8 ``q``; value ``d * q``.

They map onto :mod:`proxy.quant.linear`'s planes with no loss (group size 32), as do ``Q4_K``
(one int4 plane) and ``Q5_0`` / ``IQ4_NL`` / ``IQ4_XS`` (int8 codes with a scale per 32), decoded
in :mod:`proxy.quant.gguf_types`. Every other type is handled by :func:`load_gguf_linears`' rules:
float types (F32/F16/BF16) stay dense, the rest (``Q6_K``, ``Q5_1``, ``Q5_K``, the other K-quants and
IQ types) are re-quantized to int8 groups of 32 from the dequantized weight, logged per type with
the reason and the bytes it costs.

llama.cpp's converter permutes the rows of llama's q/k projections for its RoPE layout; the loader
finds each tensor's row order against the dense weight (:mod:`proxy.quant.gguf_rows`) and keeps any
tensor it cannot match exactly dense, with a warning. The file's tensor index and name map come
from :mod:`proxy.quant.gguf_file`.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from proxy.quant.apply import (
    named_linears,
    output_layer,
    replace_linear,
    set_module,
    trim_heap,
    untie_lm_head,
)
from proxy.quant.embedding import pack_q8_embedding
from proxy.quant.gguf_file import GGUFTensor, gguf_tensors, hf_to_gguf_names
from proxy.quant.gguf_rows import ModuleWeights, WeightSource, match_row_order, planes_rows, q8_rows
from proxy.quant.gguf_types import (
    CODE_TYPES,
    GROUP_16_TYPES,
    INT4_TYPES,
    INT8_TYPES,
    ZERO_TYPES,
    exact_layout,
    int8_codes,
    log_not_at_own_precision,
    q4_k_planes,
    q4_k_rounded_zeros,
)
from proxy.quant.int8_linear import Int8Linear, kernel_available
from proxy.quant.linear import Int4Plane, int8_planes, quantize_int8, quantize_int8_codes

logger = logging.getLogger(__name__)

GROUP_SIZE = 32
LOSSLESS_TYPES = INT4_TYPES + INT8_TYPES
#: int8 types whose layout (groups of 16, zeros) only :class:`Int8Linear` on the kernel serves
KERNEL_ONLY_TYPES = GROUP_16_TYPES + ZERO_TYPES
DENSE_TYPES = ("F32", "F16", "BF16", "F64")


def decode_blocks(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> list[Int4Plane]:
    """Planes holding exactly the values of a tensor of one of :data:`LOSSLESS_TYPES`: one int4
    plane (``Q4_0``, ``Q4_1``, ``Q4_K``: :func:`~proxy.quant.gguf_types.q4_k_planes`, whose groups
    with a rounded zero are logged) or the two planes of int8 codes (:func:`int8_planes` of
    :func:`~proxy.quant.gguf_types.int8_codes`; not :data:`KERNEL_ONLY_TYPES`).

    Args:
        type_name: the GGML type's name.
        raw: the tensor's bytes, uint8 ``[N, K / block * block_bytes]`` (``GGUFReader``'s ``data``).
        shape: ``(N, K)``: output rows, input features.
    Raises:
        ValueError: another type.
    """
    n, k = shape
    g = k // GROUP_SIZE
    if type_name in INT8_TYPES and type_name not in KERNEL_ONLY_TYPES:  # planes: groups of 32, no zeros
        return int8_planes(*int8_codes(type_name, raw, shape)[:2])
    if type_name == "Q4_K":
        planes, inexact = q4_k_planes(raw, shape)
        if inexact:
            logger.warning("Q4_K %s: %d of %d groups' zero (8 d sc - dmin m) rounded in fp32; their "
                           "weights may differ from the file's in the last bit", shape, inexact, n * g)
        return planes
    head = {"Q4_0": 2, "Q4_1": 4}.get(type_name)
    if head is None:
        raise ValueError(f"{type_name} blocks are not decoded losslessly")
    blocks = np.ascontiguousarray(raw).reshape(n, g, head + 16)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    qs = blocks[..., head:]
    codes = torch.from_numpy(np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k))
    if type_name == "Q4_0":
        return [Int4Plane(codes, d, torch.zeros_like(d))]
    m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    return [Int4Plane(codes, d, m + 8.0 * d)]


def _set_int8_linear(
    model: nn.Module, name: str, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
    scheme: str, device: torch.device, tied: bool, zeros: torch.Tensor | None = None,
) -> None:
    """Replace linear ``name`` by an :class:`~proxy.quant.int8_linear.Int8Linear` (the ``Q8_0`` CPU
    kernel); ``tied``: it is the output layer over ``token_embd``, whose input embedding then takes
    the same codes (:func:`proxy.quant.embedding.pack_q8_embedding`)."""
    layer = Int8Linear(codes.to(device), scales.to(device), bias, scheme,
                       None if zeros is None else zeros.to(device))
    layer.tied_embedding = tied
    set_module(model, name, layer)


def _int8_layer(
    model: nn.Module, name: str, tensor: GGUFTensor, type_name: str, source: WeightSource, pname: str,
    shape: tuple[int, int], heads: list[int], bias: torch.Tensor | None, device: torch.device, tied: bool,
    exact: bool,
) -> str:
    """Linear ``name`` as an :class:`~proxy.quant.int8_linear.Int8Linear`: ``exact``, the tensor's own
    int8 codes (:func:`~proxy.quant.gguf_types.int8_codes`; rows matched to the dense weight
    as :func:`match_row_order` does), else re-quantized to int8 g32 from the dense weight. Returns
    the outcome to count."""
    if exact:
        codes, scales, zeros = int8_codes(type_name, tensor.data, shape)
        tensor.release()  # the codes are copies
        order = match_row_order(q8_rows(codes, scales, zeros), codes.shape[0],
                                functools.partial(source.rows, pname), heads)
        if order is False:
            logger.warning("%s: %s blocks do not match the dense weight, stays dense", name, type_name)
            return f"{type_name} -> dense (no match)"
        if order is not None:
            assert isinstance(order, torch.Tensor)
            codes, scales = codes[order], scales[order]
            zeros = None if zeros is None else zeros[order]
        scheme = f"int8 g{shape[1] // scales.shape[1]}"
        _set_int8_linear(model, name, codes, scales, bias, f"{type_name} as {scheme}", device, tied, zeros)
        return f"{type_name} -> {scheme}"
    codes, scales = quantize_int8_codes(source.full(pname), GROUP_SIZE)
    scheme = f"{type_name} as int8 g32 (re-quantized)"
    _set_int8_linear(model, name, codes, scales, bias, scheme, device, False)
    return f"{type_name} -> int8 g32 (re-quantized)"


def _module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (what a layer holds once packed)."""
    return sum(t.nbytes for t in (*module.parameters(), *module.buffers()))


def load_gguf_linears(
    model: nn.Module,
    path: Path,
    kernel_dtype: torch.dtype,
    weights: WeightSource | None = None,
    device: torch.device | None = None,
    dense_dtype: torch.dtype | None = None,
    skip: tuple[str, ...] = (),
) -> Counter[str]:
    """Replace ``model``'s linears by packed layers built from the GGUF file's own blocks.

    ``weights`` is the dense reference each tensor is matched against: the folder transformers
    converted from this file. By default the model's own weights (a dense model); with a source
    that reads the folder (``proxy.models``' low-memory path) the model's linears may sit on the
    ``meta`` device (then ``device`` says where to pack), and only the sampled rows of each
    reference are ever read (no dense copy of a packed linear exists; its ``meta`` weight is
    dropped with the module). Per linear: ``Q4_0``/``Q4_1``/``Q4_K`` -> int4 g32 and
    ``Q8_0``/``Q5_0``/``IQ4_NL``/``IQ4_XS`` -> int8 g32, ``Q6_K`` -> int8 g16 and ``Q5_1``/``Q5_K``
    -> int8 g32 with zeros (these on the int8 kernel only), lossless (:data:`LOSSLESS_TYPES`); other
    quantized types -> int8 g32 re-quantized from the dequantized weight, logged per type with the
    reason and the bytes; float types, unknown names and shapes the kernel refuses stay dense.
    A tied lm_head uses ``token_embd``; a ``token_embd`` of an int8 type also serves the input
    embedding from its codes (:func:`proxy.quant.embedding.pack_q8_embedding`); a quantized one of
    another type stays dense (counted ``"token_embd Q4_K -> dense"`` and logged). On
    a CPU that runs the ``Q8_0`` kernel (:func:`proxy.quant.int8_linear.kernel_available`) every
    int8 g32 linear (int8 types, re-quantized types) is an :class:`~proxy.quant.int8_linear.Int8Linear`
    instead of two int4 planes (the same weights, fp32 activations, no dense copy: its prompt rows
    take the kernel too), counted under the same names; a tied one shares the embedding's codes.
    ``dense_dtype``: every packed linear but the output layer also gets the dense copy of
    :func:`proxy.quant.apply.add_dense_weights`, made from its planes while they exist. Linears under
    ``skip`` (module name prefixes: an mmproj's vision tower, in another file) are left alone.

    Returns:
        counts per outcome, e.g. ``{"Q4_1 -> int4 g32": 210, "Q8_0 -> int8 g32": 1,
        "token_embd Q8_0 -> int8 g32": 1}``.
    """
    config: Any = model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    arch, tensors = gguf_tensors(path)
    names = hf_to_gguf_names(arch, int(getattr(config, "num_hidden_layers", 0)))
    heads = [
        h for h in (getattr(config, "num_attention_heads", 0), getattr(config, "num_key_value_heads", 0)) if h
    ]
    untie_lm_head(model)
    out = output_layer(model)
    source: WeightSource = ModuleWeights(model) if weights is None else weights
    device = device or next(model.parameters()).device
    counts: Counter[str] = Counter()
    costs: dict[str, list[int]] = {}  # outcome -> [tensors, file bytes, served bytes], not at own precision
    q8_kernel = device.type == "cpu" and kernel_available()
    for name, linear in named_linears(model):
        if name.startswith(skip):
            continue
        pname = f"{name}.weight"
        gname = names.get_name(name) if names is not None else None
        tensor = tensors.get(f"{gname}.weight") if gname else None
        if tensor is None and gname == "output":
            tensor = tensors.get("token_embd.weight")  # tied lm_head
        if tensor is None:
            logger.warning("%s: no GGUF tensor found, stays dense", name)
            counts["not found -> dense"] += 1
            continue
        type_name = tensor.type_name
        n, k = linear.out_features, linear.in_features
        if type_name in DENSE_TYPES:
            counts[f"{type_name} -> dense"] += 1
            continue
        bias: torch.Tensor | None = linear.bias
        if bias is not None and bias.is_meta:
            bias = source.full(f"{name}.bias")
        layout = exact_layout(type_name, k)
        if type_name in KERNEL_ONLY_TYPES and not q8_kernel:
            layout = None  # the int4 planes take groups of 32 and no zeros (requantize_reason)
        if layout == "int4" and type_name == "Q4_K" and q8_kernel and q4_k_rounded_zeros(tensor.data, (n, k)):
            layout = "int8"  # its int4 plane would round a zero; int8 codes with zeros hold it exactly
        if q8_kernel and layout != "int4" and k % GROUP_SIZE == 0:
            tied = linear is out and tensor is tensors.get("token_embd.weight")
            outcome = _int8_layer(model, name, tensor, type_name, source, pname, (n, k), heads, bias, device,
                                  tied, layout == "int8")
            counts[outcome] += 1
            if "re-quantized" in outcome:
                cost = costs.setdefault(outcome, [0, 0, 0])
                cost[0], cost[1] = cost[0] + 1, cost[1] + tensor.data.nbytes
                cost[2] += _module_bytes(model.get_submodule(name))
            trim_heap()
            continue
        if layout is not None:
            planes = decode_blocks(type_name, tensor.data, (n, k))
            tensor.release()  # the planes are copies
            order = match_row_order(planes_rows(planes), n, functools.partial(source.rows, pname), heads)
            if order is False:
                logger.warning("%s: %s blocks do not match the dense weight, stays dense", name, type_name)
                counts[f"{type_name} -> dense (no match)"] += 1
                continue
            if order is not None:
                assert isinstance(order, torch.Tensor)
                planes = [p.select_rows(order) for p in planes]
            scheme = f"{layout} g32"
        elif k % GROUP_SIZE == 0:
            planes = quantize_int8(source.full(pname), GROUP_SIZE)
            scheme = "int8 g32 (re-quantized)"
        else:
            counts[f"{type_name} -> dense"] += 1
            continue
        ok = replace_linear(model, name, planes, GROUP_SIZE, kernel_dtype, f"{type_name} as {scheme}",
                            device, bias, dense_dtype if linear is not out else None)
        del planes
        trim_heap()
        outcome = f"{type_name} -> {scheme}" if ok else f"{type_name} -> dense (shape)"
        counts[outcome] += 1
        if ok and layout is None:
            cost = costs.setdefault(outcome, [0, 0, 0])
            cost[0], cost[1] = cost[0] + 1, cost[1] + tensor.data.nbytes
            cost[2] += _module_bytes(model.get_submodule(name))
    embd = tensors.get("token_embd.weight")
    if embd is not None:
        _embedding(model, embd, source, device, counts, costs)
        embd.release()
    log_not_at_own_precision(costs)
    return counts


def _embedding(model: nn.Module, embd: GGUFTensor, source: WeightSource, device: torch.device,
               counts: Counter[str], costs: dict[str, list[int]]) -> None:
    """Serve the input embedding from ``token_embd``'s int8 codes where its type has an int8 layout
    (:func:`proxy.quant.embedding.pack_q8_embedding`; a tied :class:`Int8Linear` lm_head shares its
    codes); count the outcome, and a quantized table left dense in ``costs``."""
    type_name = embd.type_name
    if type_name in DENSE_TYPES or len(embd.shape) != 2:
        return
    shared = output_layer(model)
    decoded = None
    if isinstance(shared, Int8Linear) and shared.tied_embedding:
        decoded = (shared.codes, shared.scales, shared.zeros)
    elif type_name in CODE_TYPES and exact_layout(type_name, embd.shape[1]) is not None:
        decoded = int8_codes(type_name, embd.data, (embd.shape[0], embd.shape[1]))
    if decoded is not None and pack_q8_embedding(model, type_name, embd.data, source.rows, device, decoded):
        counts[f"token_embd {type_name} -> int8 g{embd.shape[1] // decoded[1].shape[1]}"] += 1
        trim_heap()
        return
    get_in = getattr(model, "get_input_embeddings", None)
    table = get_in() if callable(get_in) else None
    if isinstance(table, nn.Module):
        outcome = f"token_embd {type_name} -> dense"
        counts[outcome] += 1
        cost = costs.setdefault(outcome, [0, 0, 0])
        cost[0], cost[1], cost[2] = cost[0] + 1, cost[1] + embd.data.nbytes, cost[2] + _module_bytes(table)
