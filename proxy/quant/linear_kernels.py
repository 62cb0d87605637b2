"""Which kernels the loaders build a model's linears for (:class:`LinearKernels`): the loaders' part
of the execution plan, chosen before loading by
``proxy.engine.execution.choice.choose_execution`` (which reads
the switches and the CPU) and handed to ``proxy.models.load.load_model``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from proxy.quant import amx_int4
from proxy.quant.dense_prefill import dense_prefill_default, dense_weight_dtype


@dataclass(frozen=True)
class LinearKernels:
    """The kernels a model's linears are built for.

    Attributes:
        amx_int4: one-plane int4 layers take the AMX int4 kernel where their shape allows
            (``proxy.quant.amx_int4``); False: torch's int4 kernel.
        dense_prefill: packed linears get dense copies for prompt tokens computed in this dtype
            (``proxy.quant.dense_prefill``), or None: prompt tokens take the packed kernels.
    """

    amx_int4: bool
    dense_prefill: torch.dtype | None

    @classmethod
    def choose(cls, dense_prefill: bool | None, device: torch.device, amx: bool) -> LinearKernels:
        """The kernels for ``device``: ``dense_prefill`` is ``Settings.dense_prefill`` (None: on where
        :func:`~proxy.quant.dense_prefill.dense_prefill_default` says), the copies in
        :func:`~proxy.quant.dense_prefill.dense_weight_dtype`; ``amx``: the AMX kernel where a
        layer's shape allows (the caller checked the switch and that it runs here)."""
        if dense_prefill is None:
            dense_prefill = dense_prefill_default(device)
        return cls(amx_int4=amx, dense_prefill=dense_weight_dtype(device) if dense_prefill else None)

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """Build layers inside this block for these kernels (the AMX choice is read by each
        ``PackedLinear`` as it is built: :func:`proxy.quant.amx_int4.enabled`)."""
        with amx_int4.enabled(self.amx_int4):
            yield
