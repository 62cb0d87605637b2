"""torch's packed weight-only int4 kernels, per device, and the CPU feature check behind dtype "auto".

We call torch's own ops rather than torchao: on the CPU, torchao's int4 weight-only layout
(``Int4CPULayout``) calls exactly these ops, and torchao 0.18 ships C++ extensions built against
one torch release (a pin we would have to follow); the GGUF loader also needs to hand the kernel
given codes, scales and zeros, which torchao's quantize-from-float API does not take.

- CPU: ``torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes int32 [N, K], inner_k_tiles)``
  -> uint8 ``[N, K / 2]``; ``torch.ops.aten._weight_int4pack_mm_for_cpu(x [M, K], packed,
  group_size, scales_and_zeros [K / group_size, N, 2])`` -> ``[M, N]``, all of ``x``'s dtype.
  Needs ``N % 16 == 0``. Measured on this project's 2-core AVX-512/AMX machine (1 thread,
  [1536 x 576] weight, 1 row): bf16 0.06 ms, fp32 1.8 ms, fp16 2.9 ms; on a 2-core AVX2-only AMD
  EPYC (2 threads, same weight): bf16 0.12 ms (1 row) / 0.48 ms (8 rows), fp32 2.7 / 21 ms, where
  a dense fp32 matmul takes 0.13 / 0.58 ms with the weight in cache and ~3x that from memory.
  Only bf16 is fast, with or without BF16 instructions, so the CPU kernel dtype is bf16 on CPUs
  with AVX2 or BF16 instructions.
- CUDA: ``torch.ops.aten._convert_weight_to_int4pack(uint8 [N, K / 2], inner_k_tiles)`` (two
  codes a byte, even index in the high nibble, as torchao packs) and
  ``torch.ops.aten._weight_int4pack_mm`` (tinygemm), bf16 only; ``N % 8 == 0`` and
  ``K % (16 * inner_k_tiles) == 0`` with ``inner_k_tiles`` in {8, 4, 2}. Written and guarded, not
  run on this project's CPU machines.

Both compute, per weight, ``fma(code - 8, scale, zero)`` in fp32 (checked bit for bit on the CPU)
and round once to the activation dtype.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from proxy.settings import TORCH_OPS_ENV, execution_switches

#: group sizes the CUDA tinygemm kernel accepts (the CPU one takes any divisor of K).
CUDA_GROUP_SIZES = (32, 64, 128, 256)


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The ``flags`` of the first processor in ``/proc/cpuinfo`` (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_bf16_flags() -> list[str]:
    """The CPU's BF16 compute features (``avx512_bf16``, ``amx_bf16``) that make bf16 matmuls and
    the packed int4 kernel fast; empty on CPUs without them (there bf16 was 2-3x slower than fp32)."""
    flags = cpu_flags()
    return [f for f in ("avx512_bf16", "amx_bf16") if f in flags]


def kernel_dtype(device: torch.device) -> torch.dtype:
    """Activation dtype the packed kernel runs in: bf16 on CUDA and on CPUs with BF16 instructions
    or AVX2 (torch's kernel widens bf16 in registers there), else fp32 (correct but slow on the
    CPU; see the module docstring)."""
    if device.type == "cuda" or cpu_bf16_flags() or "avx2" in cpu_flags():
        return torch.bfloat16
    return torch.float32


def is_fast(device: torch.device) -> bool:
    """Whether the packed kernel serves faster than dense weights here, so that quantization
    ``"auto"`` packs a GGUF: on CUDA and on every CPU where the kernel runs bf16 activations
    (:func:`kernel_dtype`: BF16 instructions or AVX2). Without BF16 instructions prompt tokens take
    dense fp32 copies (``proxy.quant.dense_prefill``), since the kernel computes many rows slowly
    there. Measured on a 2-core AVX2-only AMD EPYC, SmolLM2-135M, packed + fp32 copies against
    dense fp32: decode step 27-30 / 81-89 ms for 1 / 16 requests against 52 / 88 ms, a 512-token
    prefill 0.98 against 1.55 s, 16 prompts of 32 tokens in one step 0.87 against 0.79 s."""
    return kernel_dtype(device) == torch.bfloat16


def supports_shape(out_features: int, in_features: int, group_size: int, device: torch.device) -> str | None:
    """None when a ``[out_features, in_features]`` weight can be packed with ``group_size``;
    else the reason it cannot (the module then stays dense)."""
    if in_features % group_size:
        return f"in_features {in_features} is not a multiple of the group size {group_size}"
    if device.type == "cuda":
        if group_size not in CUDA_GROUP_SIZES:
            return f"group size {group_size} is not one of {CUDA_GROUP_SIZES} (CUDA tinygemm)"
        if out_features % 8:
            return f"out_features {out_features} is not a multiple of 8 (CUDA tinygemm)"
        if _cuda_inner_k_tiles(in_features) is None:
            return f"in_features {in_features} is not a multiple of 32 (CUDA tinygemm)"
        return None
    if out_features % 16:
        return f"out_features {out_features} is not a multiple of 16 (CPU int4 kernel)"
    return None


def _cuda_inner_k_tiles(in_features: int) -> int | None:
    for tiles in (8, 4, 2):
        if in_features % (16 * tiles) == 0:
            return tiles
    return None


#: rows packed at a time on the CPU (a multiple of 16, the kernel's N granularity).
PACK_ROWS = 4096


def pack_int4(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Pack int4 codes for the kernel on ``device``.

    Args:
        codes: integer tensor ``[N, K]`` with values in ``0..15`` (any device).
    Returns:
        the opaque packed weight (uint8 on the CPU: ``[N, K / 2]``; int32 tiles on CUDA).
    """
    if device.type == "cuda":
        tiles = _cuda_inner_k_tiles(codes.shape[1])
        if tiles is None:
            raise ValueError(f"in_features {codes.shape[1]} cannot be packed for CUDA")
        c = codes.to(device=device, dtype=torch.int32)
        as_bytes = ((c[:, ::2] << 4) | c[:, 1::2]).to(torch.uint8)
        packed: torch.Tensor = torch.ops.aten._convert_weight_to_int4pack(as_bytes, tiles)
        return packed
    # The CPU layout is row-wise ([N, K / 2]): packing PACK_ROWS rows at a time gives the same bytes
    # and bounds the int32 copy the op needs (113 MB for the default model's lm_head at once).
    parts = [
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes[i:i + PACK_ROWS].to(torch.int32).cpu().contiguous(), 1
        )
        for i in range(0, codes.shape[0], PACK_ROWS)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def int4_mm(
    x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    """``x @ dequant(W).T`` with ``dequant(W)[n, k] = (code - 8) * scale + zero`` of k's group.

    Args:
        x: ``[M, K]`` activations in the kernel dtype.
        packed: from :func:`pack_int4` on ``x``'s device.
        scales_and_zeros: ``[K / group_size, N, 2]`` in ``x``'s dtype.
    Returns:
        ``[M, N]`` in ``x``'s dtype.
    """
    y: torch.Tensor = int4_mm_for(x.device)(x, packed, group_size, scales_and_zeros)
    return y


Int4MM = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]
"""The signature of :func:`int4_mm`."""


def int4_mm_for(device: torch.device) -> Int4MM:
    """The op :func:`int4_mm` calls on ``device``, for callers that call it often (a packed
    linear looks it up once a call): the overload itself, since the packet's ``__call__`` costs
    ~1 us of a ~40 us call, ~120 calls a decode step."""
    return _CUDA_INT4_MM if device.type == "cuda" else _CPU_INT4_MM


_LIBRARY = torch.library.Library("streamproxy", "FRAGMENT")

def _load_torch_ops() -> str | None:
    """Load ``proxy.quant._torch_ops`` (``ext/kernels/torch_ops.cpp``: the C++ CPU kernels of the ops
    :func:`define_cpu_op` defines); None when loaded, else why not. Runs at import, before any op is
    defined (an op takes the C++ kernel only if it is registered first), so it reads its switch
    (``ExecutionSwitches.torch_ops``, ``STREAMPROXY_TORCH_OPS=0``) itself."""
    if not execution_switches().torch_ops:
        return f"turned off ({TORCH_OPS_ENV}=0)"
    spec = importlib.util.find_spec("proxy.quant._torch_ops")
    if spec is None or spec.origin is None:
        return "not built (torch was not importable when the project was built)"
    try:  # a library built against another torch fails here (undefined symbols)
        torch.ops.load_library(spec.origin)
    except (OSError, RuntimeError) as exc:
        logging.getLogger(__name__).warning(
            "the C++ kernels of the streamproxy ops did not load (%s: %s); the Python kernels serve "
            "(rerun `make setup` after a torch upgrade)", type(exc).__name__, exc)
        return f"{type(exc).__name__}: {exc}"
    return None


#: why the C++ kernels are not in use (None when they are: :func:`cpp_kernels_loaded`)
TORCH_OPS_ERROR: str | None = _load_torch_ops()


def cpp_kernels_loaded() -> bool:
    """Whether the ops of :func:`define_cpu_op` run their C++ kernels (``proxy.quant._torch_ops``)."""
    return TORCH_OPS_ERROR is None


def define_cpu_op(schema: str, kernel: Callable[..., torch.Tensor],
                  fake: Callable[..., torch.Tensor]) -> None:
    """Define the op ``streamproxy::<schema>`` (a schema string such as ``"q8_matmul(Tensor x, Tensor
    codes, Tensor scales, int isa) -> Tensor"``) with ``fake`` as its shape function, so that
    ``torch.compile`` keeps a call as one opaque node; its CPU kernel is the C++ one of
    ``ext/kernels/torch_ops.cpp`` where that library loaded (:func:`cpp_kernels_loaded`), else
    ``kernel``. Why C++: a compiled decode step (inductor's C++ wrapper, which releases the GIL)
    calls these ops ~120 times a step; a Python kernel takes the GIL back each call (waiting for the
    server's event loop thread) and costs several microseconds more (``docs/compile.md``).
    Registered through ``torch.library.Library`` rather than ``torch.library.custom_op``, whose
    Python wrappers cost more again; the op has no autograd formula (inference only).

    Raises:
        RuntimeError: an op of that name is already defined, or the C++ kernel's signature does not
            match ``schema``.
    """
    name = schema.split("(", 1)[0]
    _LIBRARY.define(schema)
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"streamproxy::{name}", "CPU"):
        _LIBRARY.impl(name, kernel, "CPU")
    torch.library.register_fake(f"streamproxy::{name}", fake, lib=_LIBRARY)


_CPU_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_CUDA_INT4_MM = torch.ops.aten._weight_int4pack_mm.default
