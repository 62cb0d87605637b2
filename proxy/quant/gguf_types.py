"""GGUF block types beyond ``Q4_0`` / ``Q4_1`` / ``Q8_0`` decoded into layouts that hold the file's values.

Block layouts (ggml ``ggml-common.h``, ``dequantize_row_*`` of ``ggml-quants.c``; gguf-py's
``gguf.quants`` is the reference the tests compare with; ``QK_K`` = 256 weights a super-block):

- ``Q4_K``: 144 bytes a super-block: ``d``, ``dmin`` (fp16), 12 bytes of 6-bit sub-block scales
  ``sc`` and mins ``m`` (8 each), 128 bytes of nibbles; sub-block ``2j`` is the low nibbles of bytes
  ``32j .. 32j + 31``, sub-block ``2j + 1`` their high nibbles; value ``d * sc * q - dmin * m``.
- ``Q5_0``: 22 bytes: ``d`` (fp16), ``qh`` (32 fifth bits, little-endian), 16 bytes of nibbles
  (weights ``j`` and ``j + 16`` in byte ``j``); value ``d * (q - 16)``.
- ``Q5_1``: 24 bytes: ``d``, ``m`` (fp16), ``qh`` and nibbles as ``Q5_0``; value ``d * q + m``.
- ``Q5_K``: 176 bytes a super-block: ``d``, ``dmin``, 12 scale bytes as ``Q4_K``, ``qh`` (32 bytes:
  bit ``s`` of byte ``i`` is the fifth bit of weight ``i`` of sub-block ``s``), 128 bytes of nibbles
  as ``Q4_K``; value ``d * sc * q - dmin * m``.
- ``IQ4_NL``: 18 bytes: ``d`` (fp16), 16 bytes of nibbles as ``Q4_0``; value ``d * kvalues[q]``
  (:data:`IQ4_KVALUES`, int8).
- ``IQ4_XS``: 136 bytes a super-block: ``d`` (fp16), ``scales_h`` (uint16: 2 high bits a
  sub-block), ``scales_l`` (4 bytes: 4 low bits a sub-block), 128 bytes of nibbles (16 a sub-block
  of 32, as ``IQ4_NL``); value ``d * (ls - 32) * kvalues[q]``.
- ``Q6_K``: 210 bytes a super-block: ``ql`` (128 bytes: in half ``h``, bytes ``64h .. 64h + 63``
  hold weights ``128h + i`` in their low nibbles and ``128h + 64 + i`` in their high ones), ``qh``
  (64 bytes: byte ``32h + i`` holds the top 2 bits of weights ``128h + 32s + i`` at bits ``2s``),
  16 int8 ``scales`` (one a 16 weights), ``d`` (fp16); value ``d * scale * (q - 32)``.

``Q4_K`` maps onto one :class:`~proxy.quant.linear.Int4Plane` in groups of 32 (:func:`q4_k_planes`);
``Q8_0``, ``Q5_0``, ``IQ4_NL`` and ``IQ4_XS`` onto int8 codes with one fp32 scale per 32 weights
(:func:`int8_codes`), ``Q6_K`` onto int8 codes with one fp32 scale per 16, and ``Q5_1`` / ``Q5_K``
onto int8 codes with a scale and a zero per 32 (the last two served only by the int8 kernel, which
takes groups of 16 and zeros), each product exact in fp32. The types without such a layout here are
re-quantized by the loader, for the reason :func:`requantize_reason` gives.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from proxy.quant.embedding import q8_0_codes
from proxy.quant.linear import Int4Plane

logger = logging.getLogger(__name__)

GROUP_SIZE = 32
QK_K = 256
#: types held as one int4 plane in groups of 32 / as int8 codes with a scale per 32
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT8_TYPES = ("Q8_0", "Q5_0", "IQ4_NL", "IQ4_XS", "Q6_K", "Q5_1", "Q5_K")
#: the int8 types whose codes come with a scale per 16 weights (:func:`int8_codes`), not 32
GROUP_16_TYPES = ("Q6_K",)
#: the int8 types whose groups have a zero term too
ZERO_TYPES = ("Q5_1", "Q5_K")
#: the types :func:`int8_codes` decodes (``Q4_K`` for an embedding table; its linears take int4)
CODE_TYPES = (*INT8_TYPES, "Q4_K")
#: the weights a block of each type covers (the input dimension must be a multiple)
BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q4_K": QK_K, "Q8_0": 32, "Q5_0": 32, "IQ4_NL": 32, "IQ4_XS": QK_K,
                 "Q6_K": QK_K, "Q5_1": 32, "Q5_K": QK_K}
#: ``kvalues_iq4nl`` of ``ggml-common.h``
IQ4_KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)

_REASONS = {
    "Q6_K": "a scale per 16 weights: only the int8 kernel (x86-64 with AVX2) takes groups of 16",
    "Q5_1": "5-bit codes plus a min per 32: only the int8 kernel (x86-64 with AVX2) adds a zero term",
    "Q5_K": "5-bit codes plus a min per 32: only the int8 kernel (x86-64 with AVX2) adds a zero term",
}


def requantize_reason(type_name: str) -> str:
    """Why a tensor of ``type_name`` is not served at its own precision (for the load log)."""
    return _REASONS.get(type_name, f"no packed layout holds {type_name} blocks here")


def log_not_at_own_precision(costs: dict[str, list[int]]) -> None:
    """One line per GGUF type served at another precision: how many tensors, why, and the bytes the
    file holds against the bytes served (``costs``: outcome -> ``[tensors, file bytes, served bytes]``)."""
    mib = 1 << 20
    for outcome, (count, file_bytes, served) in sorted(costs.items()):
        type_name = outcome.split(" -> ")[0].removeprefix("token_embd ")
        reason = requantize_reason(type_name)
        if outcome.startswith("token_embd ") and type_name in CODE_TYPES:
            reason = "the input embedding is not a plain nn.Embedding, or its rows differ from the file's"
        logger.info("GGUF %s x%d, not at its own precision (%s): %.1f MiB in the file, %.1f MiB served "
                    "(%+.1f MiB)", outcome, count, reason, file_bytes / mib, served / mib,
                    (served - file_bytes) / mib)


def exact_layout(type_name: str, in_features: int) -> str | None:
    """``"int4"`` or ``"int8"``: the layout :func:`q4_k_planes` / :func:`int8_codes` (or
    ``gguf_blocks.decode_blocks``) gives a tensor of ``type_name`` with ``in_features`` inputs; None
    when there is none (the type, or an input size that is not a whole number of blocks). The int8
    layouts of :data:`GROUP_16_TYPES` and :data:`ZERO_TYPES` run only on the int8 kernel."""
    block = BLOCK_WEIGHTS.get(type_name)
    if block is None or in_features % block:
        return None
    return "int4" if type_name in INT4_TYPES else "int8"


def _blocks(raw: np.ndarray, n: int, k: int, block: int, nbytes: int) -> np.ndarray:
    return np.ascontiguousarray(raw).reshape(n, k // block, nbytes)


def _f16(two_bytes: np.ndarray) -> np.ndarray:
    """fp32 values of the fp16 fields ``[..., 2]`` (uint8): ``[...]``."""
    return np.ascontiguousarray(two_bytes).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """uint8 ``[..., 16]`` -> ``[..., 32]``: the low nibbles, then the high ones (a 32-weight block)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit ``(sc, m)`` uint8 ``[..., 8]`` of ``Q4_K`` / ``Q5_K``'s 12 scale bytes ``[..., 12]``
    (``get_scale_min_k4``): bytes 0-3 hold ``sc`` 0-3 (low 6 bits) and the top bits of ``sc`` 4-7,
    bytes 4-7 ``m`` 0-3 and the top bits of ``m`` 4-7, bytes 8-11 the low 4 bits of ``sc`` / ``m`` 4-7."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    dq, mq, low = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([dq & 0x3F, (low & 0x0F) | ((dq >> 2) & 0x30)], axis=-1)
    m = np.concatenate([mq & 0x3F, (low >> 4) | ((mq >> 2) & 0x30)], axis=-1)
    return sc, m


def q4_k_planes(raw: np.ndarray, shape: tuple[int, int]) -> tuple[list[Int4Plane], int]:
    """The plane of a ``Q4_K`` tensor: codes ``q``, ``scale = d * sc``, ``zero = 8 * scale - dmin * m``
    per 32 weights (the plane's ``(code - 8) * scale + zero`` is ``d * sc * q - dmin * m``).

    ``scale`` and ``dmin * m`` are exact in fp32 (an 11-bit fp16 significand times a 6-bit integer);
    where ``zero`` is exact too, the plane's fp32 value (:meth:`Int4Plane.dequantize`, one rounding)
    is gguf's ``d * sc * q - dmin * m`` bit for bit: the exact sum, rounded once. ``zero`` is exact
    when ``d`` and ``dmin`` are within a factor of about 16 of each other (llama.cpp's quantizer
    gives ``dmin / d`` near 7 for centred weights); the other groups are counted.

    Args:
        raw: the tensor's bytes, uint8 ``[N, K / 256 * 144]``.
        shape: ``(N, K)``, ``K`` a multiple of 256.
    Returns:
        ``([plane], groups whose zero was rounded)``; the plane's fields as :class:`Int4Plane`.
    """
    n, k = shape
    blocks = _blocks(raw, n, k, QK_K, 144)
    qs = blocks[..., 16:].reshape(n, k // QK_K, 4, 32)
    codes = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k)
    scale, zero, inexact = _q4_k_zero(blocks, n, k)
    plane = Int4Plane(torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(zero))
    return [plane], inexact


def _q4_k_zero(blocks: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``(scale, zero, groups whose zero was rounded)`` of :func:`q4_k_planes`."""
    scale, neg_dm = _k_scales(blocks, n, k)
    zero = np.float32(8.0) * scale + neg_dm
    inexact = int(np.count_nonzero(zero.astype(np.float64) != 8.0 * scale.astype(np.float64) + neg_dm))
    return scale, zero, inexact


def q4_k_rounded_zeros(raw: np.ndarray, shape: tuple[int, int]) -> int:
    """How many groups of a ``Q4_K`` tensor :func:`q4_k_planes` would round the zero of (reads only
    the scales); where any, :func:`int8_codes` holds the tensor exactly (codes with a zero)."""
    return _q4_k_zero(_blocks(raw, shape[0], shape[1], QK_K, 144), *shape)[2]


Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def _q5(blocks: np.ndarray, at: int) -> np.ndarray:
    """The 5-bit ``q`` uint8 ``[..., 32]`` of ``Q5_0`` / ``Q5_1`` blocks, ``qh`` at byte ``at``."""
    qh = np.ascontiguousarray(blocks[..., at:at + 4]).view(np.uint32)  # [n, g, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [n, g, 32]: bit j -> weight j
    return np.asarray(_nibbles(blocks[..., at + 4:at + 20]) | (high << 4))


def _q5_0(raw: np.ndarray, n: int, k: int) -> Decoded:
    blocks = _blocks(raw, n, k, 32, 22)
    return (_q5(blocks, 2).astype(np.int8) - np.int8(16)).reshape(n, k), _f16(blocks[..., 0:2]), None


def _q5_1(raw: np.ndarray, n: int, k: int) -> Decoded:
    blocks = _blocks(raw, n, k, 32, 24)
    return _q5(blocks, 4).astype(np.int8).reshape(n, k), _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])


def _k_scales(blocks: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(d * sc, -(dmin * m))`` fp32 ``[n, k / 32]`` of ``Q4_K`` / ``Q5_K`` super-blocks (both exact)."""
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, m = k_scale_min(blocks[..., 4:16])
    scale = (d[..., None] * sc.astype(np.float32)).reshape(n, k // GROUP_SIZE)
    return scale, -(dmin[..., None] * m.astype(np.float32)).reshape(n, k // GROUP_SIZE)


def _q4_k(raw: np.ndarray, n: int, k: int) -> Decoded:
    blocks = _blocks(raw, n, k, QK_K, 144)
    qs = blocks[..., 16:].reshape(n, k // QK_K, 4, 32)
    codes = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k)
    return (codes.astype(np.int8), *_k_scales(blocks, n, k))


def _q5_k(raw: np.ndarray, n: int, k: int) -> Decoded:
    blocks = _blocks(raw, n, k, QK_K, 176)
    qs = blocks[..., 48:].reshape(n, k // QK_K, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k // QK_K, 8, 32)
    qh = blocks[..., 16:48].reshape(n, k // QK_K, 1, 32)
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1  # [n, nb, 8, 32]
    codes = (low | (high << 4)).astype(np.int8).reshape(n, k)
    return (codes, *_k_scales(blocks, n, k))


def _iq4_nl(raw: np.ndarray, n: int, k: int) -> Decoded:
    blocks = _blocks(raw, n, k, 32, 18)
    return IQ4_KVALUES[_nibbles(blocks[..., 2:18])].reshape(n, k), _f16(blocks[..., 0:2]), None


def _iq4_xs(raw: np.ndarray, n: int, k: int) -> Decoded:
    blocks = _blocks(raw, n, k, QK_K, 136)
    d = _f16(blocks[..., 0:2])
    scales_h = np.ascontiguousarray(blocks[..., 2:4]).view(np.uint16)  # [n, nb, 1]
    high = (scales_h >> np.arange(0, 16, 2, dtype=np.uint16)) & 3  # [n, nb, 8]
    low = np.stack([blocks[..., 4:8] & 0x0F, blocks[..., 4:8] >> 4], axis=-1).reshape(*d.shape, 8)
    ls = (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 32
    scales = (d[..., None] * ls.astype(np.float32)).reshape(n, k // GROUP_SIZE)
    codes = IQ4_KVALUES[_nibbles(blocks[..., 8:].reshape(n, k // QK_K, 8, 16))]
    return codes.reshape(n, k), scales, None


def _q6_k(raw: np.ndarray, n: int, k: int) -> Decoded:
    blocks = _blocks(raw, n, k, QK_K, 210)
    ql = blocks[..., :128].reshape(n, k // QK_K, 2, 1, 64)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=3)  # [n, nb, 2, 2, 64]: weight 128h + 64j + i
    qh = blocks[..., 128:192].reshape(n, k // QK_K, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 3  # [n, nb, 2, 4, 32]
    q = low.reshape(n, k // QK_K, 2, 128) | (high.reshape(n, k // QK_K, 2, 128) << 4)
    scales = _f16(blocks[..., 208:210])[..., None] * blocks[..., 192:208].view(np.int8).astype(np.float32)
    return (q.astype(np.int8) - np.int8(32)).reshape(n, k), scales.reshape(n, k // 16), None


def int8_codes(
    type_name: str, raw: np.ndarray, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(codes int8 [N, K], scales fp32 [N, K / group], zeros)`` with ``codes * scales + zeros`` the
    tensor's values, ``group`` 32 (16 for :data:`GROUP_16_TYPES`), ``zeros`` fp32 shaped as the
    scales for :data:`ZERO_TYPES` and ``Q4_K`` (``m``, ``-dmin * m``), else None. Each product is
    exact in fp32 (an int8 code times an fp16 ``d``, ``IQ4_XS``'s ``d * (ls - 32)``: 17 significant
    bits times 7, ``Q6_K``'s ``d * scale``: 18 bits times 6, a K-quant's ``d * sc``: 17 bits times
    5), so ``codes * scales + zeros`` in fp32 is gguf's dequantization bit for bit (its one rounding
    is the sum's, as in gguf's ``d * q - dm``).

    Args:
        type_name: one of :data:`CODE_TYPES`.
        raw: the tensor's bytes, uint8 ``[N, K / block * block_bytes]``.
        shape: ``(N, K)``, ``K`` a multiple of the type's block (:data:`BLOCK_WEIGHTS`).
    Raises:
        ValueError: another type.
    """
    n, k = shape
    if type_name == "Q8_0":
        return (*q8_0_codes(raw, shape), None)
    decode = {"Q5_0": _q5_0, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs, "Q6_K": _q6_k, "Q5_1": _q5_1,
              "Q5_K": _q5_k, "Q4_K": _q4_k}.get(type_name)
    if decode is None:
        raise ValueError(f"{type_name} blocks have no int8 layout here")
    codes, scales, zeros = decode(raw, n, k)
    return (torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(np.ascontiguousarray(scales)),
            None if zeros is None else torch.from_numpy(np.ascontiguousarray(zeros)))
