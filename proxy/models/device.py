"""The device and dtype the weights are served in (``settings.device`` / ``settings.dtype``,
``"auto"`` resolved).

Device ``"auto"``: CUDA when available, else CPU. Dtype ``"auto"``: bf16 on CUDA and on CPUs
whose ``/proc/cpuinfo`` flags have ``avx512_bf16`` or ``amx_bf16`` (there bf16 prefill ran 1.9x
and batched decode 1.4x faster than fp32), fp32 on other CPUs (bf16 was 2-3x slower there).
"""

from __future__ import annotations

import logging

import torch

from proxy.models.loaded import ModelLoadError
from proxy.quant import cpu_bf16_flags
from proxy.settings import Settings

logger = logging.getLogger(__name__)


def resolve_device_dtype(settings: Settings) -> tuple[torch.device, torch.dtype]:
    """``settings.device`` / ``settings.dtype`` with ``"auto"`` resolved.

    Raises:
        ModelLoadError: an unknown dtype, or CUDA requested but unavailable.
    """
    if settings.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(settings.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ModelLoadError("device 'cuda' requested but CUDA is not available")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if settings.dtype == "auto":
        dtype, why = auto_dtype(device)
        logger.info("dtype auto: %s (%s)", str(dtype).removeprefix("torch."), why)
    elif settings.dtype in dtypes:
        dtype = dtypes[settings.dtype]
    else:
        raise ModelLoadError(f"unknown dtype {settings.dtype!r}")
    return device, dtype


def auto_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """``(dtype, reason)`` for dtype ``"auto"``: bf16 on CUDA and on CPUs with BF16 instructions
    (``avx512_bf16`` / ``amx_bf16`` in ``/proc/cpuinfo``), else fp32."""
    if device.type == "cuda":
        return torch.bfloat16, "CUDA"
    flags = cpu_bf16_flags()
    if flags:
        return torch.bfloat16, "CPU has " + " and ".join(flags)
    return torch.float32, "CPU has neither avx512_bf16 nor amx_bf16; bf16 would be slower than fp32"
