"""``PackedLinear``: a weight-only quantized replacement for ``nn.Linear``, and float -> int4 / int8.

A weight is one or two *int4 planes* in groups of ``group_size`` consecutive input features:

    plane value [n, k] = (code[n, k] - 8) * scale[n, g] + zero[n, g],   g = k // group_size

- int4 (one plane): asymmetric min/max per group, ``scale = (max - min) / 15``,
  ``zero = min + 8 * scale`` (the tinygemm convention torchao's int4 weight-only layout uses).
  GGUF ``Q4_0`` (``d * (q - 8)``) is ``scale = d, zero = 0``; ``Q4_1`` (``d * q + m``) is
  ``scale = d, zero = m + 8 * d``.
- int8 (two planes): symmetric int8 codes ``q`` in groups (``Q8_0``: ``d * q``) as nibbles
  ``q = 16 * hi + lo``: plane 1 codes ``hi + 8``, ``scale = 16 d``, ``zero = 0``; plane 2 codes
  ``lo``, ``scale = d``, ``zero = 8 d``; their sum is ``d * q`` exactly (torch's int8 kernel has
  one scale a channel, not ``Q8_0``'s per group). Where the ``Q8_0`` CPU kernel runs, int8 g32 is an
  :class:`~proxy.quant.int8_linear.Int8Linear` instead.

Planes are built in fp32 (:class:`Int4Plane`), then packed once for torch's kernel on the device,
or for the AMX kernel (:mod:`proxy.quant.amx_int4`: one-plane bf16 layers where it runs). In fp32
the weights equal the planes' values bit for bit; in bf16 the scales and zeros are rounded to bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from proxy.quant import amx_int4, kernels
from proxy.quant.dense_prefill import RowPlan, current_row_plan, dense_rows_mm, dense_rows_of, merge_rows


@dataclass
class Int4Plane:
    """One int4 plane in fp32, before packing.

    Attributes:
        codes: uint8 ``[N, K]``, values ``0..15``.
        scale: fp32 ``[N, K / group_size]``.
        zero: fp32 ``[N, K / group_size]``.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dequantize(self, group_size: int) -> torch.Tensor:
        """fp32 ``[N, K]`` values, computed as the kernel does (``fma`` in float64, one rounding)."""
        n, k = self.codes.shape
        q = self.codes.reshape(n, k // group_size, group_size).double() - 8.0
        return (
            torch.addcmul(self.zero.double()[..., None], q, self.scale.double()[..., None])
            .float()
            .reshape(n, k)
        )

    def dequantize_exact_products(self, group_size: int) -> torch.Tensor:
        """fp32 ``[N, K]``: ``(code - 8) * scale + zero`` in fp32 ops, for scales whose products with
        a 4-bit code are exact in fp32 (fp16 or bf16 values): equal to :meth:`dequantize`, faster."""
        n, k = self.codes.shape
        v = self.codes.reshape(n, k // group_size, group_size).float().sub_(8.0)
        return v.mul_(self.scale[..., None]).add_(self.zero[..., None]).reshape(n, k)

    def select_rows(self, index: torch.Tensor) -> Int4Plane:
        """The same plane with output rows reordered (``index``: long ``[N]``)."""
        return Int4Plane(self.codes[index], self.scale[index], self.zero[index])


def kernel_view(planes: list[Int4Plane], group_size: int, kernel_dtype: torch.dtype) -> torch.Tensor:
    """The weight ``[N, K]`` in ``kernel_dtype`` that :class:`PackedLinear` of ``planes`` computes
    with (what :meth:`PackedLinear.dequantize`, an identity matmul, returns), from the planes.

    In bf16 the kernels read ``scale`` and ``zero`` rounded to bf16; ``(code - 8) * scale`` is then
    exact in fp32, so ``fl32(product + zero)`` rounded to bf16 is the weight (two planes add in fp32,
    round once). In fp32: :meth:`Int4Plane.dequantize`. Tested: ``tests/quant/test_linear.py``.
    """
    if kernel_dtype != torch.bfloat16:
        total = None
        for p in planes:
            v = p.dequantize(group_size)
            total = v if total is None else total + v
        assert total is not None
        return total.to(kernel_dtype)
    out: torch.Tensor | None = None
    for p in planes:
        rounded = Int4Plane(p.codes, p.scale.to(kernel_dtype).float(), p.zero.to(kernel_dtype).float())
        v = rounded.dequantize_exact_products(group_size).to(kernel_dtype)
        out = v if out is None else out.float().add_(v.float())
    assert out is not None
    return out.to(kernel_dtype)


def int8_planes(q: torch.Tensor, d: torch.Tensor) -> list[Int4Plane]:
    """Two planes whose sum is ``d * q`` exactly.

    Args:
        q: int8 ``[N, K]`` codes.
        d: fp32 ``[N, K / group_size]`` per-group scales.
    """
    q = q.to(torch.int8)
    hi = (q >> 4).add_(8).view(torch.uint8)  # floor(q / 16) + 8: 0..15 (arithmetic shift)
    lo = (q & 15).view(torch.uint8)  # q - 16 * floor(q / 16): 0..15
    zeros = torch.zeros_like(d)
    return [
        Int4Plane(hi, d * 16.0, zeros),
        Int4Plane(lo, d.clone(), d * 8.0),
    ]


def quantize_int4(weight: torch.Tensor, group_size: int) -> list[Int4Plane]:
    """Asymmetric min/max int4 in groups of ``group_size`` (``weight``: ``[N, K]``, K divisible)."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    lo = w.amin(dim=2)
    hi = w.amax(dim=2)
    scale = ((hi - lo) / 15.0).clamp_min(1e-12)
    codes = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return [Int4Plane(codes.reshape(n, k), scale, lo + 8.0 * scale)]


def quantize_int8_codes(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 in groups of ``group_size`` (``Q8_0``'s scheme: ``d = max|w| / 127``):
    ``(codes int8 [N, K], d fp32 [N, K / group_size])`` of ``weight [N, K]`` (K divisible)."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    d = (w.abs().amax(dim=2) / 127.0).clamp_min(1e-12)
    q = torch.round(w / d[..., None]).clamp(-128, 127).to(torch.int8).reshape(n, k)
    return q, d


def quantize_int8(weight: torch.Tensor, group_size: int) -> list[Int4Plane]:
    """:func:`quantize_int8_codes` as two int4 planes."""
    return int8_planes(*quantize_int8_codes(weight, group_size))


class PackedLinear(nn.Module):
    """Weight-only quantized ``nn.Linear``: ``y = x @ W.T + b`` with ``W`` the sum of its int4 planes.

    Input ``[..., in_features]`` of any float dtype; computed in ``kernel_dtype`` (bf16 where
    the kernel is fast, see :mod:`proxy.quant.kernels`); output ``[..., out_features]`` in the
    input's dtype. ``bias`` stays dense (fp32 kept, added in the kernel dtype's result).

    Raises:
        ValueError: the shape cannot be packed on ``device`` (:func:`kernels.supports_shape`).
    """

    packed0: torch.Tensor  # buffers registered in __init__: plane 0, and plane 1 of int8
    #: the plan's dense rows (prompt tokens) take the prompt-row kernel (``apply.use_prompt_tiles``)
    prompt_tiles: bool = False
    scales_and_zeros0: torch.Tensor
    packed1: torch.Tensor
    scales_and_zeros1: torch.Tensor

    def __init__(
        self,
        planes: list[Int4Plane],
        bias: torch.Tensor | None,
        group_size: int,
        device: torch.device,
        kernel_dtype: torch.dtype,
        scheme: str,
        dense_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        n, k = planes[0].codes.shape
        why = kernels.supports_shape(n, k, group_size, device)
        if why:
            raise ValueError(why)
        self.in_features = k
        self.out_features = n
        self.group_size = group_size
        self.kernel_dtype = kernel_dtype
        self.scheme = scheme
        self.num_planes = len(planes)
        #: on the AMX kernel (proxy.quant.amx_int4, its own layout), else on torch's int4 kernel
        self.amx = amx_int4.why_not(n, k, group_size, len(planes), device, kernel_dtype) is None
        for i, plane in enumerate(planes):
            if self.amx:
                packed, sz = amx_int4.pack(plane.codes, plane.scale, plane.zero)
            else:
                packed = kernels.pack_int4(plane.codes, device)
                sz = torch.stack([plane.scale.t(), plane.zero.t()], -1).to(device, kernel_dtype)  # [G, N, 2]
            self.register_buffer(f"packed{i}", packed, persistent=False)
            self.register_buffer(f"scales_and_zeros{i}", sz.contiguous(), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(device), requires_grad=False)
        self.dense_weight: torch.Tensor | None = None
        self.dense_dtype: torch.dtype | None = None
        if dense_dtype is not None and kernel_dtype == torch.bfloat16:  # a dense copy from the planes
            self.set_dense_weight(kernel_view(planes, group_size, kernel_dtype).to(device), dense_dtype)

    @classmethod
    def concat(cls, parts: list[PackedLinear]) -> PackedLinear:
        """One layer whose output rows are ``parts``' rows in order (their outputs side by side).

        All parts must share ``in_features``, ``group_size``, ``kernel_dtype``, the number of planes,
        the kernel and whether they have a bias, and sit on the CPU, whose packed layouts are row-wise
        (torch's) or block-wise (AMX's).
        """
        assert len({p.amx for p in parts}) == 1, "parts on different kernels"
        first = parts[0]
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features = first.in_features
        layer.out_features = sum(p.out_features for p in parts)
        layer.group_size, layer.kernel_dtype = first.group_size, first.kernel_dtype
        layer.num_planes, layer.scheme, layer.amx = first.num_planes, first.scheme, first.amx
        for i in range(first.num_planes):
            layer.register_buffer(f"packed{i}", torch.cat([getattr(p, f"packed{i}") for p in parts]),
                                  persistent=False)
            layer.register_buffer(f"scales_and_zeros{i}",
                                  torch.cat([getattr(p, f"scales_and_zeros{i}") for p in parts], dim=1),
                                  persistent=False)
        biases = [p.bias for p in parts]
        layer.bias = None if first.bias is None else nn.Parameter(
            torch.cat([b for b in biases if b is not None]), requires_grad=False)
        layer.dense_weight = layer.dense_dtype = None
        weights = [p.dense_weight for p in parts]
        if all(w is not None for w in weights) and len({p.dense_dtype for p in parts}) == 1:
            layer.set_dense_weight(torch.cat(weights), first.dense_dtype)  # type: ignore[arg-type]
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = xin = x.reshape(-1, self.in_features)
        kernel_dtype = self.kernel_dtype
        if x2.dtype is not kernel_dtype:
            x2 = x2.to(kernel_dtype)
        if not x2.is_contiguous():  # the kernel needs a contiguous A (generate()'s last-position slice)
            x2 = x2.contiguous()
        if x2.shape[0] == 0:
            return x.new_empty(*lead, self.out_features)
        plan = current_row_plan() if self.dense_weight is not None or self.prompt_tiles else None
        if plan is not None and plan.num_tokens == x2.shape[0]:
            y = self._mixed_rows(x2, xin, plan, x.dtype)
        else:
            y = self._finish(self._packed_mm(x2), x.dtype)
        return y.reshape(*lead, self.out_features)

    def _finish(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Add the bias in ``y``'s dtype, then round once to ``dtype``."""
        bias = self.bias
        if bias is not None:
            y = y + bias.to(y.dtype)
        if y.dtype is not dtype:
            y = y.to(dtype)
        return y

    def _packed_mm(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 [M, K] @ W.T`` through the packed kernel, no bias."""
        # ~120 calls a decode step: the buffers are read from ``_buffers`` once, not through
        # Module.__getattr__ (docs/bench/2026-12-03-avx2-decode-step.md, "Per-call overhead")
        buffers: dict[str, torch.Tensor] = self._buffers  # type: ignore[assignment]  # all registered, none None
        packed0 = buffers["packed0"]
        if self.amx:
            return amx_int4.amx_int4_mm_checked(x2, packed0, buffers["scales_and_zeros0"], self.group_size)
        mm = kernels.int4_mm_for(packed0.device)
        y = mm(x2, packed0, self.group_size, buffers["scales_and_zeros0"])
        if self.num_planes == 2:  # int8 as two nibble planes; add in fp32, round once
            y = y.float() + mm(x2, buffers["packed1"], self.group_size, buffers["scales_and_zeros1"]).float()
        return y

    def _mixed_rows(
        self, x2: torch.Tensor, xin: torch.Tensor, plan: RowPlan, dtype: torch.dtype
    ) -> torch.Tensor:
        """The plan's dense rows through :attr:`dense_weight` (or, with :attr:`prompt_tiles`, the AMX
        kernel's prompt-row variant), the others through the kernel, each finished (bias, rounding)
        as it would be alone, so a row's bits do not depend on the mix. ``x2`` is the input ``[T, K]``
        in the kernel dtype, ``xin`` as it came (the dense rows read it when it is in the dense
        weight's dtype: fp32 activations are not rounded to bf16)."""
        buffers: dict[str, torch.Tensor] = self._buffers  # type: ignore[assignment]  # all registered
        if self.dense_weight is None:  # prompt_tiles: the prompt-row kernel, any row count
            yd = amx_int4.amx_int4_prompt_mm(dense_rows_of(x2, plan), buffers["packed0"],
                                             buffers["scales_and_zeros0"], self.group_size)
        else:
            assert self.dense_dtype is not None
            wdtype, weight = self.dense_dtype, self.dense_weight
            if weight.dtype != wdtype:  # kept in bf16, widened per call (exact; ~1% of a prompt step)
                weight = weight.to(wdtype)
            xd = xin.contiguous() if xin.dtype == wdtype else x2 if x2.dtype == wdtype else x2.to(wdtype)
            yd = dense_rows_mm(xd, weight, plan)
        return merge_rows(plan, self._finish(yd, dtype), x2,
                          lambda rows: self._finish(self._packed_mm(rows), dtype))

    def set_dense_weight(self, weight: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Keep ``weight`` (``[out_features, in_features]``, bf16 or fp32) for the rows an active
        :class:`~proxy.quant.dense_prefill.RowPlan` marks dense, computed in ``dtype`` (default: the
        weight's own; a bf16 weight computed in fp32 stays bf16 in memory, widened at each call)."""
        self.dense_weight = weight.detach().contiguous()
        self.dense_dtype = weight.dtype if dtype is None else dtype

    def dequantize(self) -> torch.Tensor:
        """The weight ``[out_features, in_features]`` as the kernel sees it (an identity matmul),
        in the kernel dtype, with no bias."""
        eye = torch.eye(self.in_features, dtype=self.kernel_dtype, device=self.packed0.device)
        return self._packed_mm(eye).to(self.kernel_dtype).t().contiguous()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}, "
                f"group_size={self.group_size}, kernel_dtype={self.kernel_dtype}, "
                f"kernel={'amx' if self.amx else 'torch'}")
