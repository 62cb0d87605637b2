"""What the engine chooses to run, handed to the code that acts on it.

:class:`PrefillPlan`: prompt tokens through dense copies of the packed linears in calls of a fixed
row count (``proxy.quant.dense_prefill``). The model runner holds it (None when prompt tokens take
the packed kernels like every other token); the engine core hands its parts to the scheduler (a
prefill chunk below one call's rows costs a whole call) and the block manager (output tokens' KV
blocks kept apart from prompt blocks in the prefix cache), so neither they nor the core import the
quantization package for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class PrefillPlan:
    """Prompt tokens through dense copies of the packed linears (module docstring).

    Attributes:
        dtype: the copies' compute dtype, ``"bfloat16"`` or ``"float32"``.
        call_rows: rows of every dense call (``proxy.quant.dense_prefill.CALL_ROWS``).
        rows_by_position: a prompt token at position ``p`` sits in row ``p % call_rows`` of its
            call (bf16: oneDNN's row bits depend on the row's place); False: the step's prompt
            tokens in order (fp32: ``proxy.quant.dense_prefill.plan_rows``' ``by_position``).
    """

    dtype: str
    call_rows: int
    rows_by_position: bool

    @classmethod
    def of(cls, dtype: torch.dtype) -> PrefillPlan:
        """The plan of copies computing in ``dtype`` (bf16 or fp32)."""
        from proxy.quant.dense_prefill import CALL_ROWS

        return cls(str(dtype).removeprefix("torch."), CALL_ROWS, dtype != torch.float32)


def prefill_plan_of(model: nn.Module) -> PrefillPlan | None:
    """The :class:`PrefillPlan` of a built model: None when no packed linear holds a dense copy."""
    from proxy.quant.dense_prefill import dense_dtype_of

    dtype = dense_dtype_of(model)
    return None if dtype is None else PrefillPlan.of(dtype)
