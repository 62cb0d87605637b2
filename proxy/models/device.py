"""The device and dtype the weights are served in (``settings.device`` / ``settings.dtype``,
``"auto"`` resolved).

Device ``"auto"``: CUDA when available, else CPU. Dtype ``"auto"``: bf16 on CUDA and on CPUs
whose ``/proc/cpuinfo`` flags have ``avx512_bf16`` or ``amx_bf16`` (there bf16 prefill ran 1.9x
and batched decode 1.4x faster than fp32); on other CPUs bf16 when the linears are packed
(``--quantization int4`` / ``int8``: the packed kernel runs bf16 activations there anyway, and on a
2-core AVX2-only EPYC the default model's 8-request decode step took 140 ms with bf16 around it,
149 ms with fp32), fp32 otherwise (dense bf16 matmuls were 2-5x slower there; also the GGUF that
``--quantization auto`` packs there, whose prompt tokens take dense fp32 copies,
``proxy.quant.dense_prefill``). Batch invariance is
promised for bf16 serving on CPUs with BF16 instructions only (README): on that EPYC, bf16 SDPA gave
a row other bits when torch's flash kernel changed its row block (32 -> 64 from 192 rows).
"""

from __future__ import annotations

import logging

import torch

from proxy.models.loaded import ModelLoadError
from proxy.quant import cpu_bf16_flags, kernel_dtype
from proxy.settings import Settings

logger = logging.getLogger(__name__)


def resolve_device(settings: Settings) -> torch.device:
    """``settings.device`` with ``"auto"`` resolved (CUDA when available, else the CPU).

    Raises:
        ModelLoadError: CUDA requested but unavailable.
    """
    if settings.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(settings.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' requested but CUDA is not available")
    return device


def resolve_device_dtype(settings: Settings) -> tuple[torch.device, torch.dtype]:
    """``settings.device`` / ``settings.dtype`` with ``"auto"`` resolved (``settings.quantization``
    weighs in: packed linears take bf16 on more CPUs).

    Raises:
        ModelLoadError: an unknown dtype, or CUDA requested but unavailable.
    """
    device = resolve_device(settings)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if settings.dtype == "auto":
        dtype, why = auto_dtype(device, packed=settings.quantization in ("int4", "int8"))
        logger.info("dtype auto: %s (%s)", str(dtype).removeprefix("torch."), why)
    elif settings.dtype in dtypes:
        dtype = dtypes[settings.dtype]
    else:
        raise ModelLoadError(f"unknown dtype {settings.dtype!r}")
    return device, dtype


def auto_dtype(device: torch.device, packed: bool = False) -> tuple[torch.dtype, str]:
    """``(dtype, reason)`` for dtype ``"auto"`` (module docstring): bf16 on CUDA, on CPUs with BF16
    instructions (``avx512_bf16`` / ``amx_bf16`` in ``/proc/cpuinfo``) and, when ``packed`` (the
    linears run on the packed kernel), on every CPU where that kernel takes bf16; else fp32."""
    if device.type == "cuda":
        return torch.bfloat16, "CUDA"
    flags = cpu_bf16_flags()
    if flags:
        return torch.bfloat16, "CPU has " + " and ".join(flags)
    if packed and kernel_dtype(device) == torch.bfloat16:
        return torch.bfloat16, "packed linears, whose kernel runs bf16 activations on this CPU"
    return torch.float32, "CPU has neither avx512_bf16 nor amx_bf16; dense bf16 would be slower than fp32"


def keep_triton_out(settings: Settings) -> bool:
    """On a server that will run on the CPU, mark the ``triton`` package absent
    (``sys.modules["triton"] = None``) before anything imports ``torch._dynamo``; True when done.
    Call it before the engine loads (``proxy.engine.factory.build_engine_client``, the engine
    process's entry), not at ``serve``: the app binds before torch is imported.

    Why: ``torch._dynamo.utils`` imports triton whenever it is installed (xgrammar requires it on
    Linux), and transformers and xgrammar import ``torch._dynamo``: on the 2-core EPYC that was 71 MB
    of the default server's RSS and ~0.4 s of its start for a GPU kernel compiler the CPU path never
    runs (inductor's CPU backend emits C++, xgrammar's CPU token mask is C++). With the entry None,
    ``import triton`` raises ImportError and ``importlib.util.find_spec`` returns None, which is how
    torch (``torch.utils._triton.has_triton_package``) and transformers (``is_triton_available``)
    ask. Not done where CUDA will be used, nor when triton is imported already.
    """
    device = settings.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device.startswith("cpu") and mark_triton_absent()


def mark_triton_absent() -> bool:
    """``sys.modules["triton"] = None`` unless triton is imported already (then False): the step of
    :func:`keep_triton_out` once the server is known to run on the CPU (the engine processes' fork
    server does it on a CPU build of torch, ``proxy.engine.core_proc.fork_server``)."""
    import sys

    if "triton" in sys.modules:
        return False
    sys.modules["triton"] = None  # type: ignore[assignment]
    return True
