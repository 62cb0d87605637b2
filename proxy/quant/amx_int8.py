"""The int8 layers of an :class:`~proxy.quant.int8_linear.Int8Linear` (``Q8_0``, ``Q6_K``, ...) on this
project's AMX kernel, on CPUs with AMX-BF16 (:func:`kernel_available`), for bf16 activations; the int8
kernel (``ext/kernels/q8_matmul.h``, fp32 fused multiply-adds) elsewhere.

Why: at 16 rows the int8 kernel's fp32 multiply-adds made the 25 ``Q6_K`` layers of SmolLM2-1.7B in
``Q4_K_M`` cost more than its 144 ``Q4_K`` layers on the AMX int4 kernel
(``docs/bench/2026-12-06-1.7b-step-profile.md``). ``ext/kernels/amx_int8.h`` (built into
``proxy.quant._amx_int8``) widens the codes, exactly, to bf16 A tiles (16 output features x 32
inputs) and multiplies them with the bf16 activations with ``TDPBF16PS``, one tile product per 32
inputs (a group of 32, or both groups of 16: the B tile holds each row twice, each copy with one
half's inputs); each group's scale is applied in fp32 to the tile's sums (the header gives the exact
order). Measurements: ``docs/bench/2026-12-06-amx-int8.md``.

Numerics: every code is a bf16 value and every product ``code * x`` is exact in fp32, so the layer
computes the file's weights with the bf16 activations; the sums run in another order than the int8
kernel's, so the last bits differ from it. A row's output is the same bits whatever the other rows of
the call, the row count and the thread count, and a unit-vector input gives the weight
``code * scale`` exactly (the layer's ``dequantize``). A layer on this kernel takes it for every bf16
call, one row and a prompt's chunk alike (the batch-invariance promise).

Weights: the layer's own codes, int8 ``[N, K]`` row-major (shared with a tied embedding); the scales
tiled per block of 16 output features (:func:`pack`): fp32 ``[N / 16, K / group, 16]``, or split as
``Q6_K`` stores them (:mod:`proxy.quant.split_scales`) into fp32 block scales ``[N / 16, K / 256, 16]``
and int8 sub-scales ``[N / 16, K / 16, 16]``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from types import ModuleType

import torch

from proxy.quant.kernels import define_cpu_op
from proxy.quant.split_scales import split_scales

_amx_int8: ModuleType | None
KERNEL_IMPORT_ERROR: str | None = None
try:  # after torch: the extension's libgomp.so.1 is then torch's own (one OpenMP runtime)
    from proxy.quant import _amx_int8
except ImportError as _exc:  # not built (a compiler without AMX intrinsics or OpenMP)
    _amx_int8 = None
    KERNEL_IMPORT_ERROR = f"{type(_exc).__name__}: {_exc}"

#: output features a block covers, inputs the codes' row length must be a multiple of, group sizes
N_BLOCK = 16
K_TILE = 32
GROUPS = (16, 32)
#: inputs a split block scale covers (``Q6_K``'s super-block)
SPLIT = 256

#: whether int8 layers built in this thread / task take the kernel (:func:`enabled`); a context
#: variable, so that two models loading at once on two threads never see each other's choice
_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("amx_int8_enabled", default=True)


def kernel_available() -> bool:
    """Whether the compiled kernel is built and this CPU and OS run it (AMX-BF16, AVX-512 BW; Linux
    granted the process the tile data)."""
    return _amx_int8 is not None and bool(_amx_int8.available())


@contextlib.contextmanager
def enabled(on: bool) -> Iterator[None]:
    """Int8 layers built in this block (on this thread) take the kernel where it runs (``on``, the
    default outside any block) or the int8 fp32 kernel (False). The loaders build a model inside it
    with the execution plan's choice (``proxy.quant.linear_kernels.LinearKernels.building``)."""
    token = _ENABLED.set(on)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def why_not(out_features: int, in_features: int, group_size: int, has_zeros: bool,
            device: torch.device) -> str | None:
    """None when an int8 layer of these properties takes the kernel; else why not."""
    if not _ENABLED.get():
        return "turned off (STREAMPROXY_AMX_INT4=0: the AMX kernels)"
    if device.type != "cpu" or has_zeros or group_size not in GROUPS:
        return "the AMX int8 kernel serves int8 layers without zeros, groups of 16 or 32, on the CPU"
    if out_features % N_BLOCK or in_features % K_TILE:
        return (f"shape {out_features} x {in_features}: the AMX int8 kernel needs N % {N_BLOCK} == 0 and "
                f"K % {K_TILE} == 0")
    if not kernel_available():
        return f"the AMX int8 kernel does not run here ({KERNEL_IMPORT_ERROR or 'no AMX-BF16'})"
    return None


def _tiled(t: torch.Tensor) -> torch.Tensor:
    """``[N, C]`` -> ``[N / 16, C, 16]``: each block's 16 output features side by side."""
    n, c = t.shape
    return t.reshape(n // N_BLOCK, N_BLOCK, c).transpose(1, 2).contiguous()


def pack(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """The kernel's scales of one layer, and whether its codes fit 6 bits.

    Args:
        codes: int8 ``[N, K]``.
        scales: fp32 ``[N, K / group]``, group 16 or 32.
    Returns:
        ``(scales, sub, six_bit)``: group-16 scales that split exactly (``Q6_K``'s:
        :func:`~proxy.quant.split_scales.split_scales`) give the tiled block scales fp32
        ``[N / 16, K / 256, 16]`` and sub-scales int8 ``[N / 16, K / 16, 16]``; others the tiled scales
        fp32 ``[N / 16, K / group, 16]`` and None. ``six_bit``: every code is in ``[-32, 31]``.
    """
    split = split_scales(scales) if codes.shape[1] // scales.shape[1] == 16 else None
    six_bit = bool(codes.numel() == 0 or (int(codes.min()) >= -32 and int(codes.max()) <= 31))
    if split is not None:
        return _tiled(split[1]), _tiled(split[0]), six_bit
    return _tiled(scales), None, six_bit


def unpack_scales(scales: torch.Tensor, sub: torch.Tensor | None) -> torch.Tensor:
    """The fp32 scales ``[N, K / group]`` of :func:`pack`'s (its inverse)."""
    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(-1, t.shape[1])

    if sub is None:
        return rows(scales)
    return rows(scales).repeat_interleave(SPLIT // 16, dim=1) * rows(sub).float()


def amx_int8_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, sub: torch.Tensor | None,
                six_bit: bool) -> torch.Tensor:
    """``x @ W.T`` through the kernel, ``W[n, k] = codes[n, k] * scale[n, k / group]``.

    Args:
        x: bf16 ``[M, K]`` (made contiguous by the op).
        codes: int8 ``[N, K]``; scales, sub, six_bit: from :func:`pack`; all contiguous (a layer's
            weights, checked when packed; the op checks shapes and dtypes again).
    Returns:
        fp32 ``[M, N]``; row ``m`` is the same bits whatever the other rows and the thread count.
    Raises:
        RuntimeError: shapes or dtypes that do not fit (the op's check), or no AMX here.
    """
    columns = int((sub if sub is not None else scales).shape[1])  # K / group
    group = codes.shape[1] // columns if columns else GROUPS[0]
    out: torch.Tensor = torch.ops.streamproxy.amx_int8_mm(x, codes, scales, sub, group, six_bit)
    return out


def _amx_int8_op(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, sub: torch.Tensor | None,
                 group_size: int, six_bit: bool) -> torch.Tensor:
    """The op's Python kernel (where ``ext/kernels/torch_ops.cpp``'s is not built:
    :func:`proxy.quant.kernels.define_cpu_op`). Arguments as :func:`amx_int8_mm`."""
    if _amx_int8 is None or not _amx_int8.available():
        raise RuntimeError(f"the AMX int8 kernel does not run here ({KERNEL_IMPORT_ERROR or 'no AMX-BF16'})")
    n, k = codes.shape
    columns = k // SPLIT if sub is not None else k // max(group_size, 1)
    if (x.dim() != 2 or x.dtype != torch.bfloat16 or codes.dtype != torch.int8 or x.shape[1] != k
            or group_size not in GROUPS or k % K_TILE or n % N_BLOCK or scales.dtype != torch.float32
            or tuple(scales.shape) != (n // N_BLOCK, columns, N_BLOCK)
            or (sub is not None and (group_size != 16 or k % SPLIT or sub.dtype != torch.int8
                                     or tuple(sub.shape) != (n // N_BLOCK, k // 16, N_BLOCK)))):
        raise RuntimeError(f"amx_int8_mm: shapes do not fit (x {tuple(x.shape)} {x.dtype}, codes "
                           f"{tuple(codes.shape)}, scales {tuple(scales.shape)}, group {group_size})")
    x = x.contiguous()
    m = x.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    if m and n:
        _amx_int8.amx_int8_matmul(x.data_ptr(), m, k, codes.data_ptr(), scales.data_ptr(),
                                  0 if sub is None else sub.data_ptr(), group_size, six_bit, n,
                                  out.data_ptr(), torch.get_num_threads())
    return out


def amx_int8_prompt_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                       sub: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T`` for a step's prompt rows, ``W = bf16(code * scale)`` (rounded once per weight),
    summed over the whole ``K`` in fp32 tile registers: other bits than :func:`amx_int8_mm` (which
    applies each group's scale to the group's sums), so only rows of one kind (a request's prompt
    tokens: ``proxy.quant.dense_prefill``) take it; measured in ``docs/bench/2026-12-06-prefill-1.7b.md``.

    Args:
        x: bf16 ``[M, K]``, contiguous; codes, scales, sub: a layer's, from :func:`pack` (checked when
            packed).
    Returns:
        fp32 ``[M, N]``; row ``m`` is the same bits whatever the other rows and the thread count.
    """
    assert _amx_int8 is not None
    n, k = codes.shape
    columns = int((sub if sub is not None else scales).shape[1])  # K / group
    group = k // columns
    m = x.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    if m and n:
        _amx_int8.amx_int8_prompt_matmul(x.data_ptr(), m, k, codes.data_ptr(), scales.data_ptr(),
                                         0 if sub is None else sub.data_ptr(), group, n, out.data_ptr(),
                                         torch.get_num_threads())
    return out


def _amx_int8_fake(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, sub: torch.Tensor | None,
                   group_size: int, six_bit: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], codes.shape[0], dtype=torch.float32)


define_cpu_op("amx_int8_mm(Tensor x, Tensor codes, Tensor scales, Tensor? sub, int group_size, bool six_bit) "
              "-> Tensor", _amx_int8_op, _amx_int8_fake)


def amx_int8_mm_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                          sub: torch.Tensor | None) -> torch.Tensor:
    """What :func:`amx_int8_mm` computes, with torch ops in fp64 on the exact weights, rounded once to
    fp32 (the kernel sums in fp32 in its own order: equal up to that rounding)."""
    n, k = codes.shape
    s = unpack_scales(scales, sub).double()
    w = (codes.double().view(n, s.shape[1], -1) * s[..., None]).view(n, k)
    return (x.double() @ w.t()).float()
