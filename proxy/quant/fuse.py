"""Sibling projections that read the same input, run as one packed matmul (the model code untouched).

A decoder layer calls ``q_proj``, ``k_proj`` and ``v_proj`` on the same hidden states, and
``gate_proj`` and ``up_proj`` on the same MLP input. vLLM builds these as one ``QKVParallelLinear``
and one ``MergedColumnParallelLinear`` in its own model code; we cannot change transformers' code,
so after loading, each group of packed siblings becomes one :class:`PackedLinear` over the
concatenated output rows, registered on the parent (``q_proj+k_proj+v_proj`` ->
``fused_q_proj_k_proj_v_proj``), and each sibling a :class:`FusedSlice` that returns its columns.

- The first sibling called with a tensor ``x`` runs the fused matmul; the others, called with the
  same tensor object, take their columns of that result (a view, as transformers' ``.view`` of a
  projection needs only the last dimension contiguous). A sibling called with another tensor, or
  twice, runs the fused matmul again: always correct, never stale.
- Bits: the CPU kernel computes each output element alone over the groups of ``K``, so a fused
  column equals the separate layer's column bit for bit (tests/quant/test_fuse.py).
- Measured (2-core AVX-512 VM, one row, bf16, SmolLM2-135M's shapes): q, k, v, gate, up separately
  157 us, fused 105 us a layer: 1.6 ms of a 23 ms decode step, from 212 to 122 kernel calls.
- :class:`~proxy.quant.int8_linear.Int8Linear` siblings (a ``Q8_0`` GGUF's layers on a CPU that
  runs the ``Q8_0`` kernel) fuse the same way, by concatenating their codes and scales.
- CPU only: the CPU packed layout (``[N, K / 2]``) holds rows in blocks of 64, so layers whose
  output rows are multiples of 64 concatenate (other sizes are packed blocks with a ragged tail:
  measured, they do not); the CUDA tinygemm tiles were never run here, so CUDA models stay unfused.
"""

from __future__ import annotations

import torch
from torch import nn

from proxy.quant.apply import trim_heap
from proxy.quant.int8_linear import Int8Linear
from proxy.quant.linear import PackedLinear

#: sibling names that read one input, in the order their rows are concatenated; a group is tried
#: only where no earlier group took its first member (``q_proj`` and ``k_proj`` fuse alone where
#: ``v_proj`` has another type: a Q4_K_M file's Q6_K ``attn_v`` layers).
SIBLING_GROUPS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"), ("q_proj", "k_proj"), ("gate_proj", "up_proj"))


class _SharedResult:
    """The last fused output and the siblings that have not yet taken their columns of it."""

    def __init__(self, fused: nn.Module, num_siblings: int) -> None:
        self.fused = fused
        self.all_pending = (1 << num_siblings) - 1
        self.x: torch.Tensor | None = None
        self.y: torch.Tensor | None = None
        self.pending = 0  # bit i: sibling i has not taken its columns of ``y``

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """The fused output for ``x``, computed unless sibling ``index`` may take the cached one."""
        bit = 1 << index
        y = self.y
        if self.x is not x or not self.pending & bit or y is None:
            y = self.fused(x)
            self.x, self.y = x, y
            self.pending = self.all_pending
        self.pending &= ~bit
        if not self.pending:  # every sibling served: drop the references
            self.x = self.y = None
        return y


class FusedSlice(nn.Module):
    """One sibling of a fused group: ``y = fused(x)[..., start:stop]``.

    Input ``[..., in_features]``; output ``[..., out_features]`` (a view of the fused output, last
    dimension contiguous), in the input's dtype. No parameters of its own: the weights live in
    the fused :class:`PackedLinear` registered on the parent module.
    """

    def __init__(self, shared: _SharedResult, index: int, start: int, stop: int, in_features: int) -> None:
        super().__init__()
        self._shared = shared  # a plain object: the fused module is registered once, on the parent
        self.index = index
        self.start, self.stop = start, stop
        self.in_features = in_features
        self.out_features = stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._shared.output(self.index, x)[..., self.start:self.stop]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"columns={self.start}:{self.stop}")


#: the CPU packed layout holds output rows in blocks of this many; parts concatenate whole blocks.
CPU_ROW_BLOCK = 64


def _fusable(parts: list[object]) -> list[PackedLinear] | list[Int8Linear] | None:
    """``parts`` as packed layers when they can be fused (the rules of :func:`fuse_sibling_linears`)."""
    int8 = [p for p in parts if type(p) is Int8Linear]
    if len(int8) == len(parts):
        first8 = int8[0]
        key = (first8.in_features, first8.group_size, first8.zeros is None, first8.bias is None, first8.amx)
        if all((p.in_features, p.group_size, p.zeros is None, p.bias is None, p.amx) == key for p in int8):
            return int8
        return None
    packed = [p for p in parts if type(p) is PackedLinear]
    if len(packed) < len(parts):
        return None
    first = packed[0]
    same = all(
        p.packed0.device.type == "cpu"
        and p.out_features % CPU_ROW_BLOCK == 0
        and (p.in_features, p.group_size, p.kernel_dtype, p.num_planes, p.bias is None)
        == (first.in_features, first.group_size, first.kernel_dtype, first.num_planes, first.bias is None)
        for p in packed
    )
    return packed if same else None


def _concat(parts: list[PackedLinear] | list[Int8Linear]) -> PackedLinear | Int8Linear:
    int8 = [p for p in parts if isinstance(p, Int8Linear)]
    if int8:
        return Int8Linear.concat(int8)
    return PackedLinear.concat([p for p in parts if isinstance(p, PackedLinear)])


def _same_bits(fused: PackedLinear | Int8Linear, parts: list[PackedLinear] | list[Int8Linear]) -> bool:
    """One random row through both: the layout rule holds for this torch build."""
    if isinstance(fused, PackedLinear):
        dtype = fused.kernel_dtype
    else:  # an AMX int8 layer's bf16 path, else the int8 kernel's fp32 one
        dtype = torch.bfloat16 if fused.amx else torch.float32
    x = torch.randn(1, fused.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.inference_mode():
        return torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))


def fuse_sibling_linears(model: nn.Module) -> int:
    """Fuse every group of :data:`SIBLING_GROUPS` whose members are all CPU :class:`PackedLinear`
    of one input size, group size, kernel dtype and scheme, each with a multiple of
    :data:`CPU_ROW_BLOCK` output rows (module docstring). Groups that differ (a dense sibling,
    mixed GGUF types, 32-row projections) stay as they are, as does a group whose fused output
    would not equal the separate ones on a random row (checked once at load).

    Returns:
        the number of groups fused.
    """
    fused_count = 0
    # the parents only: a list of every module would keep the replaced parts (and their dense
    # copies) alive to the end, 175 MB of the default model's load RSS peak
    parents = [m for m in model.modules() if any(hasattr(m, names[0]) for names in SIBLING_GROUPS)]
    for parent in parents:
        for names in SIBLING_GROUPS:
            packed = _fusable([getattr(parent, n, None) for n in names])
            if packed is None:
                continue
            fused = _concat(packed)
            if not _same_bits(fused, packed):
                continue
            parent.add_module("fused_" + "_".join(names), fused)
            shared = _SharedResult(fused, len(names))
            start = 0
            sizes: list[tuple[int, int]] = [(p.out_features, p.in_features) for p in packed]
            for i, (name, (rows, cols)) in enumerate(zip(names, sizes, strict=True)):
                setattr(parent, name, FusedSlice(shared, i, start, start + rows, cols))
                start += rows
            fused_count += 1
            del packed
            trim_heap()  # the parts' heap chunks, before the next group's larger ones (load RSS peak)
    return fused_count
