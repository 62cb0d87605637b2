"""The int4 layers of a :class:`~proxy.quant.linear.PackedLinear` on this project's int4 kernel: its AMX
variant on CPUs with AMX-BF16, its AVX2 variant on the others with AVX2 and FMA (:func:`kernel_isa`);
torch's int4 kernel elsewhere.

Why: torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) costs about one more weight pass per
activation row: a 16-stream decode step spent 20.5 ms of ~46 ms in it on a 2-core AMX Xeon, against
5.3 ms at 4 rows and 2.9 ms at one (``docs/bench/2026-12-04-amx-machine.md``).
``ext/kernels/amx_int4.h`` (built into ``proxy.quant._amx_int4``) decodes each 16 x 32 block of
codes once a call into an AMX tile of bf16 ``code - 8`` values and multiplies up to 16 rows at a
time with ``TDPBF16PS``; the group's scale and zero are applied in fp32 to the tile's sums (the
header gives the exact order). Its cost barely grows with the rows of a decode step. Measurements:
``docs/bench/2026-12-04-amx-int4.md``.

Numerics: each row's output is the same bits whatever the other rows of the call, the row count and
the thread count (AMX computes each row alone; the batch-invariance promise of the README holds on
it). The weights ``(code - 8) * scale + zero`` are never rounded to bf16 (the products with the
exact ``code - 8`` and the group's sums are fp32), so outputs differ from torch's kernel's in the
last bits. For a unit-vector input it gives the dense copy's weight ``bf16((code - 8) * scale +
zero)`` exactly (:func:`proxy.quant.linear.kernel_view`), so ``PackedLinear.dequantize`` is unchanged.

Weights: codes in the header's tile order, uint8 ``[N / 16, K / 32, 256]``; scales and zeros rounded
to bf16 (as torch's bf16 kernel reads them), ``[2, N / 16, G, 16]``. Both
concatenate along output blocks (``PackedLinear.concat``). Only one-plane (int4) layers in bf16 take
the kernel; an int8 layer has :class:`~proxy.quant.int8_linear.Int8Linear`.

The AVX2 variant (``ext/kernels/avx2_int4.h``, the same weights) sums each group's products with fp32
fused multiply-adds in 8 lanes, in the order its header gives, then applies scale and zero as above:
the same promises (a row's bits do not depend on the batch or the thread count; a unit-vector input
gives the dense copy's weight), other last bits than the AMX variant's; a process runs one of the
two. Why: torch's int4 kernel widens each weight for every row and was the floor of an AVX2 decode
step (``docs/bench/2026-12-03-avx2-decode-step.md``); measured: ``docs/bench/2026-12-06-avx2-int4.md``.
The prompt-row variant (:func:`amx_int4_prompt_mm`) is AMX only.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from types import ModuleType

import torch

from proxy.quant import kernels
from proxy.quant.kernels import define_cpu_op
from proxy.settings import AMX_INT4_ENV

_amx_int4: ModuleType | None
KERNEL_IMPORT_ERROR: str | None = None
try:  # after torch: the extension's libgomp.so.1 is then torch's own (one OpenMP runtime)
    from proxy.quant import _amx_int4
except ImportError as _exc:  # not built (a compiler without AMX intrinsics or OpenMP)
    _amx_int4 = None
    KERNEL_IMPORT_ERROR = f"{type(_exc).__name__}: {_exc}"

#: inputs a weight tile covers (the group size must be a multiple) and output features a block covers
K_TILE = 32
N_BLOCK = 16
#: the largest group size (the kernel decodes one group's tiles before multiplying them)
MAX_GROUP = 256

#: ``STREAMPROXY_AMX_INT4=0`` keeps torch's int4 kernel for every layer (read by the execution
#: plan, ``proxy.engine.execution.choice``, which hands it to the loaders: :func:`enabled`)
ENV_SWITCH = AMX_INT4_ENV
#: whether layers built in this thread / task take the kernel (:func:`enabled`); a context variable,
#: so that two models loading at once on two threads never see each other's choice
_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("amx_int4_enabled", default=True)


def kernel_available() -> bool:
    """Whether the compiled kernel is built and this CPU and OS run a variant of it
    (:func:`kernel_isa`)."""
    return kernel_isa() is not None


def amx_available() -> bool:
    """Whether this process runs the AMX variant (the prompt-row kernel, :func:`amx_int4_prompt_mm`,
    is AMX only)."""
    return kernel_isa() == "amx"


def kernel_isa() -> str | None:
    """The variant this process runs: ``"amx"`` (AMX-BF16 and AVX-512 BW; Linux granted the process
    the tile data), else ``"avx2"`` (AVX2 and FMA), else None (or the extension is not built)."""
    return None if _amx_int4 is None else {2: "amx", 1: "avx2"}.get(_amx_int4.isa())


def in_use() -> bool:
    """Whether layers built now take the kernel where their shape allows (enabled and available)."""
    return _ENABLED.get() and kernel_available()


@contextlib.contextmanager
def enabled(on: bool) -> Iterator[None]:
    """Layers built in this block (on this thread) take the kernel where it runs (``on``, the
    default outside any block) or torch's int4 kernel (False). The loaders build a model inside it
    with the execution plan's choice; benchmarks and tests compare the two kernels with it."""
    token = _ENABLED.set(on)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def why_not(out_features: int, in_features: int, group_size: int, num_planes: int,
            device: torch.device, kernel_dtype: torch.dtype) -> str | None:
    """None when a layer of these properties takes the kernel; else why not."""
    if not _ENABLED.get():
        return f"turned off ({ENV_SWITCH}=0)"
    if device.type != "cpu" or kernel_dtype != torch.bfloat16 or num_planes != 1:
        return "the int4 kernel serves one-plane (int4) layers with bf16 activations on the CPU"
    if group_size % K_TILE or group_size > MAX_GROUP or in_features % group_size or out_features % N_BLOCK:
        return (f"shape {out_features} x {in_features}, group {group_size}: the int4 kernel needs N % "
                f"{N_BLOCK} == 0 and a group size that is a multiple of {K_TILE} up to {MAX_GROUP}")
    if not kernel_available():
        return f"the int4 kernel does not run here ({KERNEL_IMPORT_ERROR or 'neither AMX-BF16 nor AVX2'})"
    return None


def pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's weights of one int4 plane.

    Args:
        codes: uint8 ``[N, K]``, values ``0..15``.
        scale, zero: fp32 ``[N, G]`` (rounded here to bf16, as the bf16 kernel reads them).
    Returns:
        ``(tiles uint8 [N / 16, K / 32, 256], scales_and_zeros bf16 [2, N / 16, G, 16])``.
    """
    n, k = codes.shape
    c = codes.to(torch.uint8).reshape(n // N_BLOCK, N_BLOCK, k // K_TILE, K_TILE // 2, 2)
    # the B-tile rows (VNNI pairs), 4 at a time as [q, h, nibble, element j]; byte (q, j, h) holds
    # rows 4q + 2h (low nibble) and 4q + 2h + 1 (high), so the word (q, j) holds rows 4q .. 4q + 3
    rows = c.permute(0, 2, 3, 1, 4).reshape(n // N_BLOCK, k // K_TILE, 4, 2, 2, 2 * N_BLOCK)
    pairs = rows[:, :, :, :, 0] | (rows[:, :, :, :, 1] << 4)  # [N / 16, K / 32, q, h, j]
    tiles = pairs.permute(0, 1, 2, 4, 3).reshape(n // N_BLOCK, k // K_TILE, 256)
    g = scale.shape[1]
    sz = torch.stack([scale, zero]).to(torch.bfloat16)  # [2, N, G]
    sz = sz.reshape(2, n // N_BLOCK, N_BLOCK, g).permute(0, 1, 3, 2)
    return tiles.contiguous(), sz.contiguous()


def unpack_codes(tiles: torch.Tensor) -> torch.Tensor:
    """The uint8 codes ``[N, K]`` of :func:`pack`'s tiles (its inverse)."""
    nb, t, _ = tiles.shape
    pairs = tiles.reshape(nb, t, 4, 2 * N_BLOCK, 2)  # [nb, t, q, j, h]
    rows = torch.stack([pairs & 15, pairs >> 4], dim=5).permute(0, 1, 2, 4, 5, 3)  # [nb, t, q, h, nibble, j]
    c = rows.reshape(nb, t, K_TILE // 2, N_BLOCK, 2).permute(0, 3, 1, 2, 4)
    return c.reshape(nb * N_BLOCK, t * K_TILE).contiguous()


def amx_int4_mm(x: torch.Tensor, tiles: torch.Tensor, scales_and_zeros: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """``x @ W.T`` through the kernel, ``W`` the plane :func:`pack` packed.

    Args:
        x: bf16 ``[M, K]`` (made contiguous here).
        tiles, scales_and_zeros: from :func:`pack`, contiguous.
        group_size: the plane's group size.
    Returns:
        bf16 ``[M, N]``; row ``m`` is the same bits whatever the other rows and the thread count.
    Raises:
        ValueError: dtypes or shapes that do not fit.
        RuntimeError: the kernel is not available here.
    """
    nb, t, _ = tiles.shape
    if (x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[1] != t * K_TILE or tiles.dtype != torch.uint8
            or tuple(scales_and_zeros.shape) != (2, nb, t * K_TILE // group_size, N_BLOCK)
            or scales_and_zeros.dtype != torch.bfloat16 or group_size % K_TILE or group_size > MAX_GROUP):
        raise ValueError(f"amx_int4_mm does not fit: x {tuple(x.shape)} {x.dtype}, tiles "
                         f"{tuple(tiles.shape)}, scales_and_zeros {tuple(scales_and_zeros.shape)}, "
                         f"group {group_size}")
    if not kernel_available():
        why = KERNEL_IMPORT_ERROR or "no AMX or AVX2"
        raise RuntimeError(f"the int4 kernel is not available here ({why})")
    return amx_int4_mm_checked(x.contiguous(), tiles, scales_and_zeros, group_size)


def avx2_int4_mm(x: torch.Tensor, tiles: torch.Tensor, scales_and_zeros: torch.Tensor,
                 group_size: int) -> torch.Tensor:
    """:func:`amx_int4_mm` through the AVX2 variant whatever this CPU runs (tests and benchmarks
    compare the variants on AMX machines too). Arguments as :func:`amx_int4_mm`, unchecked.

    Raises:
        RuntimeError: the extension is not built or this CPU lacks AVX2 and FMA.
    """
    if _amx_int4 is None or "avx2" not in kernels.cpu_flags() or "fma" not in kernels.cpu_flags():
        raise RuntimeError(f"the AVX2 int4 kernel is not available here ({KERNEL_IMPORT_ERROR or 'no AVX2'})")
    return _run(x.contiguous(), tiles, scales_and_zeros, group_size, isa="avx2")


def amx_int4_mm_checked(x: torch.Tensor, tiles: torch.Tensor, scales_and_zeros: torch.Tensor,
                        group_size: int) -> torch.Tensor:
    """:func:`amx_int4_mm` on arguments already checked (``x`` contiguous; a layer's weights,
    checked when packed): ~120 calls a decode step. Eager calls go to the kernel directly, ~13 us a
    call less than through the torch op, which ``torch.compile`` sees instead."""
    if torch.compiler.is_compiling():
        out: torch.Tensor = torch.ops.streamproxy.amx_int4_mm(x, tiles, scales_and_zeros, group_size)
        return out
    return _run(x, tiles, scales_and_zeros, group_size)


def _run(x: torch.Tensor, tiles: torch.Tensor, scales_and_zeros: torch.Tensor,
         group_size: int, prompt: bool = False, isa: str | None = None) -> torch.Tensor:
    """The kernel (``prompt``: the AMX prompt-row variant; ``isa="avx2"``: the AVX2 variant, whatever
    this CPU runs; else this CPU's, :func:`kernel_isa`) on checked, contiguous arguments (the AMX
    kernel pads a call's last partial row tile)."""
    assert _amx_int4 is not None
    m, k = x.shape
    n = tiles.shape[0] * N_BLOCK
    out = torch.empty(m, n, dtype=torch.bfloat16)
    if m and n:
        sz = scales_and_zeros.data_ptr()
        zeros = sz + scales_and_zeros.shape[1] * scales_and_zeros.shape[2] * N_BLOCK * 2
        run = (_amx_int4.amx_int4_prompt_matmul if prompt else _amx_int4.avx2_int4_matmul if isa == "avx2"
               else _amx_int4.int4_matmul)
        run(x.data_ptr(), m, k, tiles.data_ptr(), sz, zeros, n, group_size, out.data_ptr(),
            torch.get_num_threads())
    return out


def amx_int4_prompt_mm(x: torch.Tensor, tiles: torch.Tensor, scales_and_zeros: torch.Tensor,
                       group_size: int) -> torch.Tensor:
    """``x @ W.T`` for a step's prompt rows, ``W`` the layer's dequantized bf16 weight (the dense
    prompt copy's values: ``bf16(fma(1, zero, fma(code - 8, scale, 0)))``), summed over the whole
    ``K`` in fp32 tile registers: ~2x the current kernel's rows a second at prompt sizes
    (``docs/bench/2026-12-06-prefill-1.7b.md``), other bits than :func:`amx_int4_mm` (whose rows sum
    each group's product before its scale), so only the rows of one kind (a request's prompt
    tokens: ``proxy.quant.dense_prefill``) take it.

    Args:
        x: bf16 ``[M, K]``, contiguous; tiles, scales_and_zeros, group_size: as :func:`amx_int4_mm`
            (checked by the layer that holds them).
    Returns:
        bf16 ``[M, N]``; row ``m`` is the same bits whatever the other rows and the thread count.
    """
    if not amx_available():  # the AVX2 variant has no prompt-row kernel (the execution plan never picks it)
        raise RuntimeError("the int4 prompt-row kernel needs the AMX variant")
    return _run(x, tiles, scales_and_zeros, group_size, prompt=True)


def _amx_int4_op(x: torch.Tensor, tiles: torch.Tensor, scales_and_zeros: torch.Tensor,
                 group_size: int) -> torch.Tensor:
    """The op's Python kernel (where ``ext/kernels/torch_ops.cpp``'s is not built:
    :func:`proxy.quant.kernels.define_cpu_op`). The op keeps a call one opaque node for
    ``torch.compile``; eager calls skip its dispatch. Arguments as :func:`amx_int4_mm`, checked there."""
    return _run(x, tiles, scales_and_zeros, group_size)


def _amx_int4_fake(x: torch.Tensor, tiles: torch.Tensor, scales_and_zeros: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], tiles.shape[0] * N_BLOCK)


define_cpu_op("amx_int4_mm(Tensor x, Tensor tiles, Tensor scales_and_zeros, int group_size) -> Tensor",
              _amx_int4_op, _amx_int4_fake)


def amx_int4_mm_reference(x: torch.Tensor, tiles: torch.Tensor, scales_and_zeros: torch.Tensor,
                          group_size: int) -> torch.Tensor:
    """What :func:`amx_int4_mm` computes, with torch ops in fp32 (the same terms, summed in another
    order: equal up to fp32 rounding before the final bf16 rounding)."""
    codes = unpack_codes(tiles)
    n, k = codes.shape
    g = k // group_size
    s = scales_and_zeros[0].float().permute(0, 2, 1).reshape(n, g)
    z = scales_and_zeros[1].float().permute(0, 2, 1).reshape(n, g)
    xg = x.float().reshape(-1, g, group_size)
    q = codes.reshape(n, g, group_size).float() - 8.0
    p = torch.einsum("mgk,ngk->mgn", xg, q)
    y = (p * s.t()[None]).sum(1) + xg.sum(2) @ z.t()
    return y.to(torch.bfloat16)
