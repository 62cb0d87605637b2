"""Prompt tokens through dense copies of the packed weights, in calls of a fixed shape.

Why: on the CPU, torch's packed int4 kernel (``_weight_int4pack_mm_for_cpu``) is fast for decode
(one row reads the 4-bit weights once) but computes many rows at ~0.15 TFLOP/s, while a dense bf16
``F.linear`` (oneDNN, AMX on CPUs that have it) reaches ~1.5 TFLOP/s. Measured on a 2-core
AVX-512/AMX VM, SmolLM2-135M's ``[576 -> 3072]`` layer, 64 rows: int4 1.87 ms, dense 0.31 ms;
128 rows: 3.08 against 0.45 ms; one row: int4 0.066 ms, dense 0.158 ms. A 128-token prefill spent
82% of its time in the int4 kernel. So prompt tokens (prefill) take the dense weights and output
tokens (decode) the packed ones, as llama.cpp picks other kernels for prompt batches. On CPUs
without BF16 instructions the copies are fp32 (:func:`dense_weight_dtype`): on a 2-core AVX2-only
EPYC a 512-token prompt of the default model took 0.98 s against 1.61 s through the kernel.

Batch invariance (a request's text must not depend on what else runs in its step, nor on how its
prompt is chunked or cached): oneDNN's dense GEMM is not row-invariant -- a row's bits change with
the call's row count and with the row's position in the call. Measured (same machine, bf16, the
model's four layer shapes and its lm_head): at a fixed call shape of 64 rows a row's bits do *not*
depend on the other rows' contents (random or zero), nor on 1 or 2 threads. So every dense call
has exactly :data:`CALL_ROWS` rows, and the prompt token at position ``p`` always sits in row
``p % CALL_ROWS`` of its call (unused rows repeat a used one). Tokens of one step whose rows collide go to
further calls: a token's call is its rank among the step's dense tokens with the same row
(:func:`plan_rows`). MKL's fp32 GEMM on that EPYC gave a row the same bits at any place in calls of
4 to 512 rows and whatever the other rows held, so fp32 copies take the step's prompt tokens in
order, one call padded to a multiple of :data:`CALL_ROWS` (``by_position=False``: no collisions, no
half-empty calls; 16 prompts of 32 tokens took 0.87 s against 1.78 s by position). Which tokens
are dense is the caller's rule and must be a property of the token
alone: the engine makes a request's prompt tokens dense and its output tokens packed, also when they
are recomputed after preemption, and keeps KV blocks that hold output tokens apart in the prefix
cache (their keys came from the packed weights).

Numerics: the dense weight is the packed kernel's own dequantized weight (``fma(code - 8, scale,
zero)`` in fp32), rounded to bf16 (and widened again for fp32 copies, which read fp32 activations
unrounded); a prompt token's activations therefore differ from the packed path by bf16 rounding,
well inside the int4 quantization error itself.

Memory: one copy of every packed linear except the lm_head (which only ever sees the sampled
rows), always held in bf16 (their size for the default model: the RSS table of
``docs/bench/2026-12-03-memory.md``). fp32 copies are widened at each call
(``PackedLinear.set_dense_weight``); measured on the AVX2 EPYC, widening the model's four layer
shapes took 0.03-0.47 ms against 2-11 ms for their 512-row GEMMs, and held in fp32 they would cost
twice the memory.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from proxy.quant import kernels

#: rows of every dense call; a prompt token at position ``p`` sits in row ``p % CALL_ROWS``.
CALL_ROWS = 64


@dataclass(frozen=True)
class RowPlan:
    """Which of a step's ``num_tokens`` flat rows take the dense weights, and where.

    Attributes:
        num_tokens: rows of the step (``T``); linears called with another row count (the lm_head on
            the sampled rows) ignore the plan.
        num_calls: dense calls of :data:`CALL_ROWS` rows each (at least 1).
        dense_src: long ``[D]``, flat indices of the dense rows, ascending.
        dense_dst: long ``[D]``, their rows in the stacked calls: ``call * CALL_ROWS + p % CALL_ROWS``.
        gather: long ``[num_calls * CALL_ROWS]``, the flat row each call row reads; rows no token
            uses read a dense row too (a row's result does not depend on the others').
        packed_src: long ``[T - D]``, the other rows (packed kernel), or None when there are none.
        num_leading_packed: when the packed rows are exactly the first ones (the step's decodes come
            first), their count, so that they are a slice; else None.
        in_place: every row is dense and already at its call row (``T`` a multiple of
            :data:`CALL_ROWS`, positions aligned): the calls read the step's rows without a copy.
        one_call: the rows are packed in step order (``by_position=False`` in :func:`plan_rows`) and
            run as one call of ``num_calls * CALL_ROWS`` rows.
    """

    num_tokens: int
    num_calls: int
    dense_src: torch.Tensor
    dense_dst: torch.Tensor
    gather: torch.Tensor
    packed_src: torch.Tensor | None
    num_leading_packed: int | None
    in_place: bool
    one_call: bool = False


def plan_rows(positions: torch.Tensor, dense: torch.Tensor, by_position: bool = True) -> RowPlan | None:
    """The plan of a step (None when no row is dense: the packed kernel alone).

    Args:
        positions: long ``[T]``, each flat row's position in its sequence.
        dense: bool ``[T]``, rows that take the dense weights (prompt tokens).
        by_position: the module docstring's rule (row ``p % CALL_ROWS``, one call per row rank), for
            GEMMs whose row bits depend on the row's place in the call (oneDNN bf16). False: the
            dense rows in step order, padded to a multiple of :data:`CALL_ROWS`, one call; for
            GEMMs whose rows do not depend on their place nor on calls of 64 or more rows
            (:func:`dense_weight_dtype`'s fp32).
    """
    dense_src = dense.nonzero().squeeze(1)
    num_dense = dense_src.numel()
    if num_dense == 0:
        return None
    if by_position:
        rows = positions[dense_src] % CALL_ROWS
        counts = torch.bincount(rows, minlength=CALL_ROWS)
        order = torch.argsort(rows, stable=True)
        first_of_row = torch.cumsum(counts, 0) - counts
        rank = torch.empty_like(rows)
        rank[order] = torch.arange(num_dense) - first_of_row[rows[order]]
        dense_dst = rank * CALL_ROWS + rows
        num_calls = int(counts.max())
    else:
        dense_dst = torch.arange(num_dense)
        num_calls = -(-num_dense // CALL_ROWS)
    gather = dense_src[:1].repeat(num_calls * CALL_ROWS)
    gather[dense_dst] = dense_src
    num_tokens = int(positions.numel())
    packed_src = (~dense).nonzero().squeeze(1)
    num_packed = packed_src.numel()
    leading = num_packed if num_packed and int(packed_src[-1]) == num_packed - 1 else None
    return RowPlan(
        num_tokens=num_tokens,
        num_calls=num_calls,
        dense_src=dense_src,
        dense_dst=dense_dst,
        gather=gather,
        packed_src=packed_src if num_packed else None,
        num_leading_packed=leading,
        in_place=num_tokens == gather.numel() and bool((gather == torch.arange(num_tokens)).all()),
        one_call=not by_position,
    )


class _ActivePlan(threading.local):
    """The row plan of the forward pass running on this thread (one engine thread runs forwards; a
    thread-local keeps a plan from leaking into another thread's pass)."""

    plan: RowPlan | None = None


_ACTIVE = _ActivePlan()


@contextlib.contextmanager
def active_row_plan(plan: RowPlan | None) -> Iterator[None]:
    """Make ``plan`` the one :class:`~proxy.quant.linear.PackedLinear` layers follow in this block
    on this thread (one forward pass of the engine; the model code between them is transformers')."""
    previous = _ACTIVE.plan
    _ACTIVE.plan = plan
    try:
        yield
    finally:
        _ACTIVE.plan = previous


def current_row_plan() -> RowPlan | None:
    """The plan set by :func:`active_row_plan` on this thread, or None."""
    return _ACTIVE.plan


def dense_rows_mm(x: torch.Tensor, weight: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """``x[plan.dense_src] @ weight.T`` in calls of :data:`CALL_ROWS` rows (module docstring).

    Args:
        x: ``[T, K]`` in ``weight``'s dtype.
        weight: ``[N, K]`` dense.
    Returns:
        ``[D, N]``, one row per ``plan.dense_src``.
    """
    stacked = x if plan.in_place else x.index_select(0, plan.gather)
    if plan.one_call:
        y = F.linear(stacked, weight)
        return y if plan.in_place else y[:plan.dense_src.numel()]
    outs = [F.linear(stacked[i * CALL_ROWS:(i + 1) * CALL_ROWS], weight) for i in range(plan.num_calls)]
    y = outs[0] if plan.num_calls == 1 else torch.cat(outs)
    return y if plan.in_place else y.index_select(0, plan.dense_dst)


def dense_rows_of(x: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """The rows of ``x`` (``[T, K]``, contiguous) the plan marks dense, in order: ``x`` itself, a slice
    when they follow the packed rows, else a gathered copy (what a prompt-row kernel computes)."""
    lead = plan.num_leading_packed
    if plan.packed_src is None:
        return x
    return x[lead:] if lead is not None else x.index_select(0, plan.dense_src)


def merge_rows(plan: RowPlan, dense_out: torch.Tensor, x: torch.Tensor,
               packed: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The step's ``[T, N]`` output: ``dense_out`` (``[D, N]``, the dense rows' finished outputs in
    order) and ``packed(rows)`` of the other rows of ``x`` (finished as alone), each at its row."""
    if plan.packed_src is None:
        return dense_out
    lead = plan.num_leading_packed
    if lead is not None:  # decodes first, then the prompt tokens: slices, one concatenation
        return torch.cat([packed(x[:lead]), dense_out])
    out = packed(x.index_select(0, plan.packed_src))
    y = dense_out.new_empty(plan.num_tokens, dense_out.shape[1])
    y.index_copy_(0, plan.dense_src, dense_out)
    y.index_copy_(0, plan.packed_src, out)
    return y


def dense_prefill_default(device: torch.device) -> bool:
    """Whether prompt tokens take dense weights when ``Settings.dense_prefill`` is None: on CPUs
    with AMX BF16 (``amx_bf16`` in ``/proc/cpuinfo``), where bf16 copies were measured 6-11x faster
    for 64-512 rows, and on CPUs with no BF16 instructions at all (AVX2), where fp32 copies are
    (:func:`dense_weight_dtype`); not on CUDA (tinygemm), nor on AVX-512 BF16 without AMX (not
    measured)."""
    if device.type != "cpu":
        return False
    return "amx_bf16" in kernels.cpu_flags() or not kernels.cpu_bf16_flags()


def dense_weight_dtype(device: torch.device) -> torch.dtype:
    """The dtype of the dense copies: bf16 on CPUs with BF16 instructions (oneDNN's AMX / AVX-512
    BF16 GEMMs), fp32 elsewhere. Measured on a 2-core AVX2-only EPYC, 64 rows: a dense bf16
    ``F.linear`` took 6.2 / 18.9 / 6.0 ms for SmolLM2-135M's ``[576 -> 960]``, ``[576 -> 3072]``,
    ``[1536 -> 576]`` layers against 0.83 / 2.7 / 1.2 ms in fp32 (bf16 there is emulated)."""
    if device.type == "cpu" and not kernels.cpu_bf16_flags():
        return torch.float32
    return torch.bfloat16


def dense_dtype_of(model: nn.Module) -> torch.dtype | None:
    """The dtype the dense copies of ``model``'s packed linears compute in
    (``proxy.quant.apply.add_dense_weights``), or None when none holds one."""
    for m in model.modules():
        if getattr(m, "dense_weight", None) is not None:
            dtype: torch.dtype = getattr(m, "dense_dtype")  # noqa: B009 - a PackedLinear's
            return dtype
    return None


def has_dense_weights(model: nn.Module) -> bool:
    """Whether any packed linear of ``model`` holds a dense copy (``proxy.quant.apply.add_dense_weights``)."""
    return dense_dtype_of(model) is not None
