"""A GGUF's ``Q8_0`` token embedding served from its own int8 codes (``--quantization auto``).

Why: the default model's embedding (49152 x 576) is stored as ``Q8_0`` (int8 codes, one fp16 scale
per 32 values); served as a dense fp32 table it held 108 MiB, the codes and fp32 scales hold 30.4
MiB. A lookup gathers the rows' codes and scales and multiplies them in fp32: ``d * q`` is exact in
fp32 (an 8-bit code times an 11-bit fp16 significand), so the rows equal the dense table's bit for
bit, which :func:`pack_q8_embedding` checks on the whole table before it swaps the module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

logger = logging.getLogger(__name__)

GROUP_SIZE = 32
Q8_0_BLOCK_BYTES = 34  # fp16 d, 32 int8 q (ggml-common.h)


def group_of(codes: torch.Tensor, scales: torch.Tensor) -> int:
    """The group size of int8 ``codes [N, K]`` with ``scales [N, K / group]``: ``K`` over the scales'
    columns (32, or 16 for ``Q6_K``); :data:`GROUP_SIZE` when ``K`` is 0."""
    k, g = int(codes.shape[-1]), int(scales.shape[-1])
    return k // g if g else GROUP_SIZE


class Int8Embedding(nn.Module):
    """``nn.Embedding`` over int8 codes with one fp32 scale per group of values (:data:`GROUP_SIZE`,
    or 16 for ``Q6_K``: :func:`group_of`).

    Args:
        codes: int8 ``[num_embeddings, embedding_dim]``.
        scales: fp32 ``[num_embeddings, embedding_dim / group]``.
        dtype: the dtype of the rows returned (the model's; the product is rounded to it once).
        zeros: None, or fp32 shaped as ``scales``, added to each group (``Q4_K`` / ``Q5_K``'s
            ``-dmin * m``, ``Q5_1``'s ``m``).

    ``forward(ids)``: long ``[...]`` -> ``[..., embedding_dim]`` in ``dtype``; row ``i`` is
    ``codes[i] * scales[i] (+ zeros[i])`` (each repeated over its group), computed in fp32: the
    product is exact, the sum rounded once.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                 zeros: torch.Tensor | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = codes.shape
        self.dtype = dtype
        self.register_buffer("codes", codes.contiguous(), persistent=False)
        self.register_buffer("scales", scales.to(torch.float32).contiguous(), persistent=False)
        self.register_buffer("zeros", None if zeros is None else zeros.contiguous(), persistent=False)
        self.group_size = group_of(codes, scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        groups = self.codes[ids].view(*ids.shape, -1, self.group_size).to(torch.float32)
        groups = groups * self.scales[ids].unsqueeze(-1)
        if self.zeros is not None:
            groups += self.zeros[ids].unsqueeze(-1)
        rows = groups.view(*ids.shape, self.embedding_dim)
        return rows if self.dtype == torch.float32 else rows.to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 g{self.group_size}, dtype={self.dtype}"


def q8_0_codes(raw: np.ndarray, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes int8 [N, K], scales fp32 [N, K / 32])`` of a ``Q8_0`` tensor's bytes (uint8, as
    :class:`proxy.quant.gguf_file.GGUFTensor` maps them)."""
    n, k = shape
    blocks = np.ascontiguousarray(raw).reshape(n, k // GROUP_SIZE, Q8_0_BLOCK_BYTES)
    scales = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(n, k))
    return codes, scales


def pack_q8_embedding(model: nn.Module, type_name: str, raw: np.ndarray,
                      rows: Callable[[str, torch.Tensor], torch.Tensor], device: torch.device,
                      decoded: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None) -> bool:
    """Swap ``model``'s input embedding for an :class:`Int8Embedding` of the GGUF's ``Q8_0`` blocks
    (or of another type's int8 codes, ``decoded``) when it is a plain ``nn.Embedding`` (not a
    subclass that scales its rows), the shape divides into groups, and every row equals the dense
    reference table: ``rows(parameter name, ids)`` returns
    rows ``ids`` (long ``[R]``, consecutive) ``[R, K]`` in the model's dtype, read 4096 at a time
    (the whole fp32 table of the default model is 113 MB; read at once it was the load's RSS peak).
    ``decoded``: the ``(codes int8 [V, K], scales fp32 [V, K / group], zeros or None)`` already
    decoded on ``device``:
    those a tied lm_head holds (:class:`proxy.quant.int8_linear.Int8Linear`), which the embedding
    then shares instead of decoding a second copy, or those of a type other than ``Q8_0`` with an
    int8 layout (``proxy.quant.gguf_types.int8_codes``); without it only ``Q8_0`` blocks are read.
    Returns whether it was swapped; a mismatch is logged and the embedding stays dense."""
    get_in = getattr(model, "get_input_embeddings", None)
    inp = get_in() if callable(get_in) else None
    if type_name != "Q8_0" and decoded is None:
        return False
    if type(inp) is not nn.Embedding or inp.embedding_dim % GROUP_SIZE:
        return False
    if inp.max_norm is not None:  # renormalizes rows in place at lookup
        return False
    shape = (inp.num_embeddings, inp.embedding_dim)
    codes, scales, zeros = (*q8_0_codes(raw, shape), None) if decoded is None else decoded
    if tuple(codes.shape) != shape:
        return False
    name = next(n for n, m in model.named_modules() if m is inp)
    pname = f"{name}.weight" if name else "weight"
    layer: Int8Embedding | None = None
    for start in range(0, shape[0], 4096):  # chunks: no dense table in memory at all
        ids = torch.arange(start, min(start + 4096, shape[0]))
        want = rows(pname, ids).to(device)
        if layer is None:
            layer = Int8Embedding(codes.to(device), scales.to(device), want.dtype,
                                  None if zeros is None else zeros.to(device))
        if not torch.equal(layer(ids.to(device)), want):
            logger.warning("the %s token embedding does not match the dense table; it stays dense", type_name)
            return False
    if layer is None:
        return False
    model.set_input_embeddings(layer)  # type: ignore[operator]
    return True
