"""What ``settings.quantization`` serves (``proxy.quant``), applied to a dense model.

``"auto"`` serves a GGUF's ``Q4_0``/``Q4_1``/``Q8_0`` linears at their own precision (packed int4 /
int8 groups of 32, lossless codes) when the packed kernels are fast here (CUDA, or a CPU with BF16
instructions or AVX2: :func:`proxy.quant.kernels.is_fast`), else dense; an HF folder is served dense.
``"int4"`` / ``"int8"`` quantize every linear from its float weight (groups of
``quantization_group_size``) except a served vision-language model's vision tower and projector,
which stay dense (:func:`proxy.models.vision.encoder_linears`); ``"none"`` serves dense.
``LoadedModel.quantization`` says what.
When ``"auto"`` packs a GGUF, :func:`proxy.models.load.load_model` skips the dense model and takes
the low-memory path of :mod:`proxy.models.packed_load` instead (:func:`gguf_packed`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from proxy.models.loaded import ModelLoadError
from proxy.models.vision import encoder_linears, is_served_vision
from proxy.quant import describe, is_fast, load_gguf_linears, quantize_linears
from proxy.quant import kernel_dtype as quant_kernel_dtype
from proxy.quant.kernels import CUDA_GROUP_SIZES
from proxy.settings import Settings

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("auto", "none", "int8", "int4")


def apply_quantization(model: Any, settings: Settings, gguf: Path | None, device: torch.device) -> str:
    """Swap ``model``'s linears for packed ones as ``settings.quantization`` says (module docstring);
    return what is served, e.g. ``"gguf: Q4_1 -> int4 g32 x210, Q8_0 -> int8 g32 x1, ..."`` or ``"none"``.

    Raises:
        ModelLoadError: an unknown method or group size.
    """
    method = settings.quantization
    if method not in QUANTIZATIONS:
        raise ModelLoadError(f"unknown quantization {method!r} (one of {', '.join(QUANTIZATIONS)})")
    if method == "none":
        return "none"
    kdtype = quant_kernel_dtype(device)
    if method == "auto":
        if gguf is None:
            return "none"
        if not is_fast(device):
            logger.info("quantization auto: dense (the packed kernel runs fp32 activations here, slowly)")
            return "none"
        with one_thread():
            counts = load_gguf_linears(model, gguf, kdtype)
        return "gguf: " + describe(counts)
    group = settings.quantization_group_size
    if group <= 0 or (device.type == "cuda" and group not in CUDA_GROUP_SIZES):
        raise ModelLoadError(f"quantization_group_size {group} is not supported on {device.type}")
    if not is_fast(device):
        logger.warning("quantization %s on a CPU without AVX2: the packed kernel is slow here", method)
    keep = encoder_linears(model) if is_served_vision(model.config) else frozenset()
    with one_thread():
        counts = quantize_linears(model, method, group, kdtype, keep)
    return f"{method}: " + describe(counts)


def gguf_packed(settings: Settings, gguf: Path | None, device: torch.device) -> bool:
    """Whether :func:`apply_quantization` would pack a GGUF's own blocks (``"auto"``, a GGUF, fast
    kernels): then :func:`proxy.models.load.load_model` takes the low-memory path,
    :func:`proxy.models.packed_load.load_gguf_packed`."""
    return settings.quantization == "auto" and gguf is not None and is_fast(device)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run a block with one torch intra-op thread, then restore the setting. Packing is thousands
    of small ops; with two threads on a busy 2-core machine each waits on an OpenMP barrier
    (the default model's packing took 98 s with 2 threads, 14-23 s with 1, same run)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
