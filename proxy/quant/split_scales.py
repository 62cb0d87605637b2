"""Group-16 scales of an :class:`~proxy.quant.int8_linear.Int8Linear` held split, as ``Q6_K`` stores
them: an int8 sub-scale per 16 weights and an fp32 block scale per 256 (:func:`split_scales`), read by
the int8 kernel's split entry (``sp_q8_matmul_split`` of ``ext/kernels/q8_matmul.h``, the op
``streamproxy::q8_matmul_split``: :func:`q8_matmul_split`).

Why: a decode step reads every weight once, so it costs the bytes it reads. With one fp32 scale per 16
int8 codes a ``Q6_K`` weight costs 1.25 bytes; split, 1 + 1/16 + 4/256 = 1.08 bytes (14% less; the
file's own 0.82 would need the 6-bit codes packed too). Measurements:
``docs/bench/2026-12-06-1.7b-step-profile.md``.

Numerics: the kernel computes each scale as ``block * sub`` in fp32. :func:`split_scales` splits only
where every such product equals the fp32 scale it stands for bit for bit (``Q6_K``'s ``d * scale``:
an 11-bit significand times an 8-bit integer is exact), and the kernel then runs the same fused
multiply-adds in the same order as with the fp32 scales: the outputs are the same bits.
"""

from __future__ import annotations

import torch

from proxy.quant.kernels import define_cpu_op

#: inputs a block scale covers (``Q6_K``'s super-block; ``SP_Q8_SPLIT`` of the kernel)
BLOCK = 256
#: inputs a sub-scale covers
SUB = 16
#: the most bits a block's scales may span at its lowest unit (they are then held in int64)
_MAX_BITS = 60


def split_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(sub int8 [N, K / 16], block fp32 [N, K / 256])`` with ``block[n, j // 16] * sub[n, j] ==
    scales[n, j]`` in fp32, bit for bit, for every scale; None where no such split was found (the
    layer keeps its fp32 scales).

    Per block of 16 scales the block scale is their greatest common factor: each scale is an integer
    times a power of two (its significand), all at the block's lowest power; the integers' gcd times
    that power is the block scale, each integer over the gcd its sub-scale (``Q6_K``'s ``d * scale``
    gives ``d`` times the gcd of the scales, or a multiple of it by a power of two). The block scale
    is negative where a sub-scale would be 128 (``Q6_K`` files as llama.cpp quantizes them: a
    negative ``d`` and a scale of -128 in every block).

    Args:
        scales: fp32 ``[N, K / 16]``, ``K`` a multiple of 256.
    """
    n, cols = scales.shape
    if scales.dtype != torch.float32 or cols % (BLOCK // SUB) or not bool(torch.isfinite(scales).all()):
        return None
    s = scales.double().view(n, cols * SUB // BLOCK, BLOCK // SUB)
    nonzero = s != 0
    _, exp = torch.frexp(s)
    unit = torch.where(nonzero, exp - 24, torch.iinfo(torch.int32).max)  # each scale: an integer * 2**unit
    low = unit.amin(-1, keepdim=True)
    high = torch.where(nonzero, exp, torch.iinfo(torch.int32).min).amax(-1, keepdim=True)
    used = nonzero.any(-1, keepdim=True)
    low = torch.where(used, low, 0)
    if bool((torch.where(used, high - low, 0) > _MAX_BITS).any()):
        return None
    ints = torch.ldexp(s, -low.double()).round().long()  # exact: each scale's significand at the block's unit
    g = ints.abs()[..., 0]
    for j in range(1, ints.shape[-1]):
        g = torch.gcd(g, ints[..., j].abs())
    g = g.unsqueeze(-1)
    sub = torch.where(g > 0, ints // g.clamp(min=1), 0)
    # a negative block scale where a sub-scale is 128: llama.cpp's Q6_K quantizer sets d = -max / 128,
    # so the block's largest scale is d * -128 (the same products: -block * -sub == block * sub)
    flip = (sub > 127).any(-1, keepdim=True)
    sub, g = torch.where(flip, -sub, sub), torch.where(flip, -g, g)
    if bool(((sub < -128) | (sub > 127)).any()):
        return None
    block = torch.ldexp(g.double(), low.double()).squeeze(-1)
    block32 = block.float()
    if not torch.equal(block32.double(), block):
        return None
    sub8 = sub.to(torch.int8).view(n, cols)
    rebuilt = block32.repeat_interleave(BLOCK // SUB, dim=1) * sub8.float()
    if not torch.equal(rebuilt.view(torch.int32), scales.view(torch.int32)):
        return None
    return sub8.contiguous(), block32.contiguous()


def q8_matmul_split(x: torch.Tensor, codes: torch.Tensor, sub: torch.Tensor, block: torch.Tensor,
                    isa: int) -> torch.Tensor:
    """``x @ W.T`` in fp32 with ``W[n, k] = codes[n, k] * (block[n, k // 256] * sub[n, k // 16])``
    through the int8 kernel's split entry: the same bits as ``proxy.quant.int8_linear.q8_matmul``
    with the scales :func:`split_scales` split.

    Args:
        x: fp32 ``[M, K]`` (made contiguous here), ``K`` a multiple of 256.
        codes: int8 ``[N, K]``; sub, block: from :func:`split_scales`; all contiguous, checked by the
            layer that holds them.
        isa: a value of the extension's ``ISAS`` this CPU runs.
    Returns:
        fp32 ``[M, N]``; row ``m`` is the same bits whatever the other rows and the thread count.
    """
    out: torch.Tensor = torch.ops.streamproxy.q8_matmul_split(x.contiguous(), codes, sub, block, isa)
    return out


def _q8_matmul_split_op(x: torch.Tensor, codes: torch.Tensor, sub: torch.Tensor, block: torch.Tensor,
                        isa: int) -> torch.Tensor:
    """The op's Python kernel (where ``ext/kernels/torch_ops.cpp``'s is not built)."""
    from proxy.quant import _q8_matmul  # built wherever an Int8Linear splits its scales

    m, k = x.shape
    n = codes.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    if m and n:
        _q8_matmul.q8_matmul_split(x.data_ptr(), m, k, codes.data_ptr(), sub.data_ptr(), block.data_ptr(), n,
                                   out.data_ptr(), torch.get_num_threads(), isa)
    return out


def _q8_matmul_split_fake(x: torch.Tensor, codes: torch.Tensor, sub: torch.Tensor, block: torch.Tensor,
                          isa: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], codes.shape[0])


define_cpu_op("q8_matmul_split(Tensor x, Tensor codes, Tensor sub, Tensor block, int isa) -> Tensor",
              _q8_matmul_split_op, _q8_matmul_split_fake)
