"""Which kernels the loaders build a model's linears for (:class:`LinearKernels`): the loaders' part
of the execution plan, chosen before loading by
``proxy.engine.execution.choice.choose_execution`` (which reads
the switches and the CPU) and handed to ``proxy.models.load.load_model``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from proxy.quant import amx_int4, amx_int8
from proxy.quant.dense_prefill import dense_prefill_default, dense_weight_dtype

#: the dense prefill copies are made by default (``Settings.dense_prefill`` None) only up to this
#: many bytes: issue 46's memory target (peak RSS at most the GGUF's size + the KV pool + 400 MiB)
#: has no room for more (a 1.7B Q4_K_M model's would take 2.5 GiB; the default model's, 202.5 MiB,
#: stay). The policy and what it costs: ``docs/serving.md``, "Dense prefill".
DEFAULT_COPY_MAX_BYTES = 256 << 20
#: the types :mod:`proxy.quant.gguf_blocks` packs into int4 planes (those get dense copies; the int8
#: types take :class:`~proxy.quant.int8_linear.Int8Linear`, which has none, where its kernel runs)
_PLANE_TYPES = ("Q4_0", "Q4_1", "Q4_K")
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def gguf_copy_bytes(path: Path, quantization: str, int8_kernel: bool) -> int | None:
    """Bytes the dense bf16 prefill copies of a GGUF's linears would take (2 bytes a weight), from
    its tensor index: with ``quantization`` ``"auto"`` the 2-D tensors of a type packed into int4
    planes (every quantized type where ``int8_kernel`` is False), with ``"int4"`` / ``"int8"`` every
    2-D tensor; the lm_head (``output`` / ``token_embd``) never gets one. None: ``"none"``, or a
    file that cannot be read. An estimate: a ``Q4_K`` tensor served as int8 codes is counted."""
    from proxy.quant.gguf_file import gguf_tensors

    if quantization == "none":
        return None
    try:
        _, tensors = gguf_tensors(path)
    except (OSError, ValueError, KeyError):
        return None
    total = 0
    for name, tensor in tensors.items():
        if len(tensor.shape) != 2 or name.startswith(("output.", "token_embd.")):
            continue
        quantized = tensor.type_name not in _FLOAT_TYPES
        packed = tensor.type_name in _PLANE_TYPES or (not int8_kernel and quantized)
        if quantization != "auto" or packed:
            total += 2 * tensor.shape[0] * tensor.shape[1]
    return total


@dataclass(frozen=True)
class LinearKernels:
    """The kernels a model's linears are built for.

    Attributes:
        amx_int4: one-plane int4 layers take this project's int4 kernel (its AMX or AVX2 variant,
            ``proxy.quant.amx_int4``) where their shape allows; False: torch's int4 kernel.
        amx_int8: int8 layers take the AMX int8 kernel for bf16 activations where their shape allows
            (``proxy.quant.amx_int8``); False: the int8 fp32 kernel (``proxy.quant.int8_linear``).
        dense_prefill: packed linears get dense copies for prompt tokens computed in this dtype
            (``proxy.quant.dense_prefill``), or None: prompt tokens take the packed kernels.
        why_no_dense_prefill: why the default made no copies where the device would take them
            (:data:`DEFAULT_COPY_MAX_BYTES`), for the execution plan's log; ``""`` otherwise.
        prompt_tiles: with no copies for that reason, prompt tokens of the AMX int4 layers take the
            kernel's prompt-row variant instead (:func:`proxy.quant.amx_int4.amx_int4_prompt_mm`:
            the copies' weights, decoded per call, no memory held).
    """

    amx_int4: bool
    dense_prefill: torch.dtype | None
    why_no_dense_prefill: str = ""
    amx_int8: bool = False
    prompt_tiles: bool = False

    @classmethod
    def choose(cls, dense_prefill: bool | None, device: torch.device, amx: bool,
               copy_bytes: int | None = None, amx_int8: bool = False,
               amx_prompt: bool | None = None) -> LinearKernels:
        """The kernels for ``device``: ``dense_prefill`` is ``Settings.dense_prefill`` (None: on where
        :func:`~proxy.quant.dense_prefill.dense_prefill_default` says and the copies' bytes,
        ``copy_bytes`` (:func:`gguf_copy_bytes`; None: unknown), are at most
        :data:`DEFAULT_COPY_MAX_BYTES`), the copies in
        :func:`~proxy.quant.dense_prefill.dense_weight_dtype`; ``amx``: the AMX kernel where a
        layer's shape allows, ``amx_int8`` the AMX int8 kernel (the caller checked the switch and
        that each runs here); ``amx_prompt``: whether the int4 kernel runs its AMX variant, which alone
        has the prompt-row kernels (None: ``amx``)."""
        why = ""
        if dense_prefill is None:
            dense_prefill = dense_prefill_default(device)
            if dense_prefill and copy_bytes is not None and copy_bytes > DEFAULT_COPY_MAX_BYTES:
                dense_prefill = False
                why = (f"off by default: the copies would take {copy_bytes / (1 << 20):.0f} MiB, over "
                       f"{DEFAULT_COPY_MAX_BYTES >> 20} MiB (the memory target); --dense-prefill makes them")
        prompt_tiles = (amx if amx_prompt is None else amx_prompt) and bool(why)
        return cls(amx_int4=amx, dense_prefill=dense_weight_dtype(device) if dense_prefill else None,
                   why_no_dense_prefill=why, amx_int8=amx_int8, prompt_tiles=prompt_tiles)

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """Build layers inside this block for these kernels (the AMX choices are read by each
        ``PackedLinear`` and ``Int8Linear`` as it is built: :func:`proxy.quant.amx_int4.enabled`,
        :func:`proxy.quant.amx_int8.enabled`)."""
        with amx_int4.enabled(self.amx_int4), amx_int8.enabled(self.amx_int8):
            yield
