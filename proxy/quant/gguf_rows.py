"""Which row order a GGUF tensor's stored rows are in, found against the dense weight.

llama.cpp's converter permutes the rows of llama's q/k projections for its RoPE layout;
transformers undoes it at load. :func:`match_row_order` compares a sample of the stored rows'
values (exactly, as the packed layer will compute them) with the dense weight transformers loaded:
identity, or the inverse permutation with the attention's or the KV heads. The sample is
:func:`check_rows`; :mod:`proxy.quant.gguf_blocks` keeps a tensor that matches no order dense.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from proxy.quant.linear import Int4Plane

GROUP_SIZE = 32


def planes_value(planes: list[Int4Plane], rows: slice) -> torch.Tensor:
    """fp32 values of ``planes`` (summed) for a slice of rows, as the fp32 kernel computes them.

    A GGUF block's scale is an fp16 value (``Q8_0``'s high plane: 16 times one), so
    :meth:`Int4Plane.dequantize_exact_products` applies (the float64 path was a fifth of the
    default model's load)."""
    out = None
    for p in planes:
        v = Int4Plane(p.codes[rows], p.scale[rows], p.zero[rows]).dequantize_exact_products(GROUP_SIZE)
        out = v if out is None else out + v
    assert out is not None
    return out


def llama_row_order(num_rows: int, num_heads: int) -> torch.Tensor | None:
    """Rows of a GGUF q/k weight in transformers' order (inverse of llama.cpp's RoPE permute)."""
    if num_heads <= 0 or num_rows % (2 * num_heads):
        return None
    dim = num_rows // num_heads // 2
    return torch.arange(num_rows).reshape(num_heads, dim, 2).transpose(1, 2).reshape(num_rows)


#: the spread part of :func:`check_rows`: this many runs of :data:`RUN_ROWS` consecutive rows.
SPREAD_RUNS = 8
RUN_ROWS = 32


def check_rows(num_rows: int) -> torch.Tensor:
    """Rows compared against the dense weight: the first 256 (two heads or more, so a wrong RoPE
    row order shows) and 256 more spread over the rest, in 8 runs of 32 consecutive rows (the last
    run ends at the last row). Decoding itself is tested exactly on whole tensors (tests/quant); at
    load a sample keeps the check under a second for the default model. Runs, not 256 single rows:
    each run is one read of the folder's weight (the single rows cost 246 reads a linear, 1.3 of
    the default model's 2.3 CPU s of reading)."""
    head = torch.arange(min(num_rows, 256))
    starts = torch.linspace(0, max(num_rows - RUN_ROWS, 0), steps=SPREAD_RUNS).long()
    spread = (starts[:, None] + torch.arange(RUN_ROWS)).flatten().clamp(max=num_rows - 1)
    rows: torch.Tensor = torch.unique(torch.cat([head, spread]))
    return rows


WeightRows = Callable[[torch.Tensor], torch.Tensor]
"""``rows (long [R]) -> the reference weight's rows [R, K]`` in the model's dtype."""


class WeightSource(Protocol):
    """Where :func:`load_gguf_linears` reads the dense reference of a linear (``name``: the
    parameter's qualified name, e.g. ``"model.layers.0.mlp.up_proj.weight"``), in the model's dtype."""

    def rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (long ``[R]``) of the weight: ``[R, K]``."""
        ...

    def full(self, name: str) -> torch.Tensor:
        """The whole weight ``[N, K]`` (only for types re-quantized from the dense weight)."""
        ...


class ModuleWeights:
    """:class:`WeightSource` over a model's own (materialized) weights."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def full(self, name: str) -> torch.Tensor:
        return self.model.get_parameter(name).detach()

    def rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        return self.full(name)[rows]


#: rows compared first: a wrong row order (llama's q/k as stored) differs within them, so the
#: rest of the sample is dequantized only for an order that may match (a fifth of the packing time).
FIRST_ROWS = 16


RowValues = Callable[[torch.Tensor], torch.Tensor]
"""``stored rows (long [R]) -> their fp32 values [R, K]``, as the packed layer will compute them."""


def planes_rows(planes: list[Int4Plane]) -> RowValues:
    """:data:`RowValues` of ``planes`` (summed)."""
    return lambda idx: planes_value([p.select_rows(idx) for p in planes], slice(None))


def q8_rows(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None) -> RowValues:
    """:data:`RowValues` of int8 ``codes [N, K]`` with fp32 ``scales [N, K / group]`` (exact products;
    ``group`` 32, or 16 for ``Q6_K``) and ``zeros`` shaped as the scales or None (added: one rounding)."""
    group = codes.shape[1] // scales.shape[1] if scales.shape[1] else GROUP_SIZE

    def values(idx: torch.Tensor) -> torch.Tensor:
        q = codes[idx]
        w = q.view(len(idx), -1, group).float() * scales[idx, :, None]
        if zeros is not None:
            w += zeros[idx, :, None]
        return w.view(q.shape)
    return values


def _equal(values: RowValues, sample: torch.Tensor, rows: torch.Tensor, order: torch.Tensor | None) -> bool:
    src = rows if order is None else order[rows]
    for part in (slice(None, FIRST_ROWS), slice(FIRST_ROWS, None)):  # the second is empty at <= 16 rows
        if len(src[part]) and not torch.equal(values(src[part]).to(sample.dtype), sample[part]):
            return False
    return True


def match_row_order(
    values: RowValues, num_rows: int, weight: torch.Tensor | WeightRows, head_counts: list[int]
) -> torch.Tensor | None | bool:
    """The row order under which the stored rows (``values``, :func:`planes_rows` or
    :func:`q8_rows`; ``num_rows`` of them) equal ``weight`` exactly (on :func:`check_rows`): None
    (as stored), an index tensor, or False (no match).

    ``weight``: the dense weight ``[N, K]``, or a function returning its rows (so that a loader
    that never materializes the dense weight reads only the sampled rows)."""
    rows = check_rows(num_rows)
    sample = weight.detach()[rows] if isinstance(weight, torch.Tensor) else weight(rows)
    if _equal(values, sample, rows, None):
        return None
    for heads in head_counts:
        order = llama_row_order(num_rows, heads)
        if order is not None and _equal(values, sample, rows, order):
            return order
    return False
