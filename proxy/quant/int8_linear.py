"""``Int8Linear``: an int8 g32 linear (a GGUF's ``Q8_0`` codes, or weights re-quantized to int8 g32), or
int8 g16 (a GGUF's ``Q6_K``), served by this project's CPU kernel; every int8 g32 linear on a CPU where
:func:`kernel_available`.

Why: the default model's lm_head is its ``Q8_0`` token embedding (tied, 49152 x 576). As a
:class:`~proxy.quant.linear.PackedLinear` it ran as two int4 planes through torch's int4 kernel
(``_weight_int4pack_mm_for_cpu``), whose cost grows with every row of a batched decode step and
whose activations are rounded to bf16. ``ext/kernels/q8_matmul.h`` (built into
``proxy.quant._q8_matmul``, AVX2 + FMA or AVX-512) reads the codes and scales as the GGUF stores them
and computes in fp32 (each weight ``codes[n, k] * scales[n, k / 32]`` exact): the GGUF's own values.
Measurements: ``docs/bench/2026-12-03-q8-lm-head.md``, ``2026-12-04-amx-machine.md``. The codes and
scales are the same tensors as the
:class:`~proxy.quant.embedding.Int8Embedding` of a tied model, held once. On CPUs with AMX-BF16 the
layers the execution plan builds for it take :mod:`proxy.quant.amx_int8` for bf16 activations instead
(tile products: cheaper per row at many rows), a step's prompt tokens its prompt-row variant where
the plan chose it (``prompt_tiles``).

In the kernel a row's output does not depend on the other rows of the call nor on the thread count
(the kernel's header says why). There is no dense copy: off the AMX kernel, calls of :data:`GEMM_ROWS`
rows or more (a prompt's chunk) dequantize the weight and take torch's fp32 GEMM (other last bits);
a decode step's calls (fewer rows) take the kernel. Where the
extension is not built or the CPU lacks AVX2/FMA (:func:`kernel_available` is False), the loader keeps
the two-plane :class:`~proxy.quant.linear.PackedLinear`; :func:`q8_matmul_reference` is the torch
twin (the tests' reference, and the forward of an ``Int8Linear`` built anyway).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from proxy.quant import amx_int8
from proxy.quant.dense_prefill import RowPlan, current_row_plan, dense_rows_of, merge_rows
from proxy.quant.embedding import GROUP_SIZE, group_of
from proxy.quant.kernels import define_cpu_op
from proxy.quant.split_scales import q8_matmul_split, split_scales

_q8_matmul: ModuleType | None
KERNEL_IMPORT_ERROR: str | None = None
try:  # after torch: the extension's libgomp.so.1 is then torch's own (one OpenMP runtime)
    from proxy.quant import _q8_matmul
except ImportError as _exc:  # not built (a compiler without OpenMP): the torch twin
    _q8_matmul = None
    KERNEL_IMPORT_ERROR = f"{type(_exc).__name__}: {_exc}"

#: output rows dequantized at a time by :func:`q8_matmul_reference` (bounds its fp32 copy)
REFERENCE_ROWS = 4096
#: calls with at least this many rows (a prompt's chunk) dequantize and take torch's fp32 GEMM (not
#: an AMX layer: its kernel is faster, ``docs/bench/2026-12-06-prefill-1.7b.md``).
#: Measured (2-core AVX2 EPYC, 2 threads, kernel / dequantize + GEMM): [4608 x 1536] 128 rows 32.3 /
#: 43.3 ms, 192 rows 48.5 / 35.8, 512 rows 142.6 / 91.3; [3072 x 576] 128 rows 8.0 / 7.2, 192 rows
#: 12.0 / 10.3, 512 rows 36.0 / 20.4; [576 x 1536] 128 rows 4.5 / 2.4, 512 rows 17.5 / 8.2.
GEMM_ROWS = 192


def kernel_available() -> bool:
    """Whether the compiled kernel is built and this CPU runs it (x86-64 with AVX2 and FMA)."""
    return _q8_matmul is not None and bool(_q8_matmul.available())


def supported_isas() -> list[str]:
    """The kernel's instruction sets this CPU runs (``"avx2"``, ``"avx512"``), best last."""
    return _q8_matmul.supported_isas() if _q8_matmul is not None else []


#: the instruction set every call uses: the best this CPU runs. The two sum a row in other orders
#: (the kernel's header), so one process keeps one; :func:`set_kernel_isa` is for tests and benchmarks.
KERNEL_ISA: str | None = supported_isas()[-1] if supported_isas() else None


def set_kernel_isa(name: str) -> None:
    """Make every later call use instruction set ``name`` (one of :func:`supported_isas`).

    Raises:
        ValueError: this CPU or build does not run ``name``.
    """
    global KERNEL_ISA
    if name not in supported_isas():
        raise ValueError(f"the Q8_0 kernel does not run {name!r} here (supported: {supported_isas()})")
    KERNEL_ISA = name


def _check(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
           zeros: torch.Tensor | None = None) -> None:
    if x.dim() != 2 or codes.dim() != 2 or scales.dim() != 2:
        raise ValueError("q8_matmul takes x [M, K], codes [N, K], scales [N, K / 32] or [N, K / 16]")
    n, k = codes.shape
    if (x.shape[1] != k or k % GROUP_SIZE or scales.shape[0] != n
            or scales.shape[1] not in (k // GROUP_SIZE, k // 16)):
        raise ValueError(
            f"q8_matmul shapes do not fit: x {tuple(x.shape)}, codes {tuple(codes.shape)}, "
            f"scales {tuple(scales.shape)} (K a multiple of {GROUP_SIZE}, a scale per 32 or 16 inputs)"
        )
    if zeros is not None and (zeros.shape != scales.shape or zeros.dtype != torch.float32):
        raise ValueError(
            f"q8_matmul takes fp32 zeros shaped as the scales, not {tuple(zeros.shape)} {zeros.dtype}")
    if x.dtype != torch.float32 or codes.dtype != torch.int8 or scales.dtype != torch.float32:
        raise ValueError(f"q8_matmul takes fp32 x and scales and int8 codes, not {x.dtype}, "
                         f"{codes.dtype}, {scales.dtype}")
    if any(t.device.type != "cpu" for t in (x, codes, scales)):
        raise ValueError("q8_matmul runs on the CPU")


def q8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
              zeros: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` with ``W[n, k] = codes[n, k] * scales[n, k // group] (+ zeros[n, k // group])``, in
    fp32, through the kernel (the product is exact, so ``W`` is the sum rounded once).

    Args:
        x: fp32 ``[M, K]`` (made contiguous here).
        codes: int8 ``[N, K]``, contiguous.
        scales: fp32 ``[N, K / group]``, contiguous; ``group`` 32, or 16 (``Q6_K``).
        zeros: None, or fp32 shaped as ``scales``, contiguous (``Q5_1``'s ``m``, ``Q5_K``'s ``-dmin * m``).
    Returns:
        fp32 ``[M, N]``; row ``m`` is the same bits whatever the other rows and the thread count.
    Raises:
        ValueError: dtypes, shapes or devices that do not fit, or non-contiguous weights.
        RuntimeError: the kernel is not available (:func:`kernel_available`).
    """
    if not torch.compiler.is_compiling():  # checked eagerly; a compiled step's shapes were checked at capture
        _check(x, codes, scales, zeros)
        if not all(t.is_contiguous() for t in (codes, scales, zeros) if t is not None):
            raise ValueError("q8_matmul takes contiguous codes and scales")
        if _q8_matmul is None or not _q8_matmul.available():
            raise RuntimeError(
                f"the Q8_0 kernel is not available here ({KERNEL_IMPORT_ERROR or 'no AVX2/FMA'})")
    out: torch.Tensor = torch.ops.streamproxy.q8_matmul(x.contiguous(), codes, scales, zeros, _isa())
    return out


def _isa() -> int:
    """The extension's value of :data:`KERNEL_ISA` (0 where the kernel is not built)."""
    return _q8_matmul.ISAS[KERNEL_ISA] if _q8_matmul is not None and KERNEL_ISA is not None else 0


def _q8_matmul_op(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                  isa: int) -> torch.Tensor:
    """The op's Python kernel (where ``ext/kernels/torch_ops.cpp``'s is not built:
    :func:`proxy.quant.kernels.define_cpu_op`). The op keeps a call one opaque node for
    ``torch.compile`` (``data_ptr`` cannot be traced). Arguments as :func:`q8_matmul`, checked there;
    ``isa`` a value of the extension's ``ISAS``."""
    assert _q8_matmul is not None
    m, k = x.shape
    n = codes.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    if m and n:
        _q8_matmul.q8_matmul(x.data_ptr(), m, k, codes.data_ptr(), scales.data_ptr(),
                             0 if zeros is None else zeros.data_ptr(), group_of(codes, scales), n,
                             out.data_ptr(), torch.get_num_threads(), isa)
    return out


def _q8_matmul_fake(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    isa: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], codes.shape[0])


define_cpu_op("q8_matmul(Tensor x, Tensor codes, Tensor scales, Tensor? zeros, int isa) -> Tensor",
              _q8_matmul_op, _q8_matmul_fake)


def q8_matmul_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                        zeros: torch.Tensor | None = None) -> torch.Tensor:
    """What :func:`q8_matmul` computes, with torch ops (the weight dequantized :data:`REFERENCE_ROWS`
    output rows at a time): the same values up to the order of the fp32 sums."""
    _check(x, codes, scales, zeros)
    n, k = codes.shape
    group = group_of(codes, scales)
    parts = []
    for start in range(0, n, REFERENCE_ROWS):
        q = codes[start:start + REFERENCE_ROWS]
        w = (q.view(q.shape[0], -1, group).float() * scales[start:start + REFERENCE_ROWS, :, None])
        if zeros is not None:
            w += zeros[start:start + REFERENCE_ROWS, :, None]
        parts.append(x @ w.view(q.shape[0], k).t())
    return torch.cat(parts, dim=1) if parts else x.new_empty(x.shape[0], 0)


class Int8Linear(nn.Module):
    """``nn.Linear`` over ``Q8_0`` codes: ``y = x @ (codes * scales).T + bias`` in fp32.

    Args:
        codes: int8 ``[out_features, in_features]``.
        scales: fp32 ``[out_features, in_features / group]``, ``group`` 32 (GGUF's fp16 ``d``, widened
            exactly) or 16 (``Q6_K``'s ``d * scale``, exact in fp32).
        zeros: None, or fp32 shaped as ``scales``: ``W = codes * scales + zeros`` (``Q5_1``, ``Q5_K``).
        bias: ``[out_features]`` or None (kept in fp32, added in fp32).
        scheme: how the weight was stored, for ``extra_repr`` and the load summary.

    ``forward(x)``: ``[..., in_features]`` of any float dtype on the CPU -> ``[..., out_features]``
    in ``x``'s dtype (computed in fp32, rounded once). bf16 calls of any row count on the AMX int8
    kernel where the layer was built for it (``amx``, chosen once at build:
    :func:`proxy.quant.amx_int8.why_not`); other calls of fewer than :data:`GEMM_ROWS` rows through
    the kernel where :func:`kernel_available`
    (group-16 scales that split exactly, ``Q6_K``'s, through its split entry:
    :mod:`proxy.quant.split_scales`, the same bits from fewer bytes); else :func:`q8_matmul_reference`.
    """

    #: the plan's dense rows (prompt tokens) take the prompt-row kernel (``apply.use_prompt_tiles``)
    prompt_tiles: bool = False
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    in_features: int
    out_features: int

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 scheme: str = "Q8_0 as int8 g32", zeros: torch.Tensor | None = None) -> None:
        super().__init__()
        _check(codes.new_empty(0, codes.shape[1], dtype=torch.float32), codes, scales, zeros)
        self.out_features, self.in_features = int(codes.shape[0]), int(codes.shape[1])
        self.group_size = group_of(codes, scales)
        self.scheme = scheme
        self.register_buffer("codes", codes.contiguous(), persistent=False)
        self.register_buffer("scales", scales.contiguous(), persistent=False)
        self.register_buffer("zeros", None if zeros is None else zeros.contiguous(), persistent=False)
        #: bf16 calls take the AMX int8 kernel (proxy.quant.amx_int8, its scales in amx_scales / amx_sub)
        self.amx = amx_int8.why_not(self.out_features, self.in_features, self.group_size, zeros is not None,
                                    codes.device) is None
        amx = amx_int8.pack(self.codes, self.scales) if self.amx else None
        self.register_buffer("amx_scales", None if amx is None else amx[0], persistent=False)
        self.register_buffer("amx_sub", None if amx is None else amx[1], persistent=False)
        self.six_bit = amx is not None and amx[2]
        split = (split_scales(self.scales) if self.group_size == 16 and zeros is None and kernel_available()
                 and codes.device.type == "cpu" and not self.amx else None)
        #: the group-16 scales split for the kernel's split entry (fewer bytes a step, same bits), or None
        self.register_buffer("sub_scales", None if split is None else split[0], persistent=False)
        self.register_buffer("block_scales", None if split is None else split[1], persistent=False)
        self.bias = None if bias is None else nn.Parameter(
            bias.detach().to(torch.float32), requires_grad=False)
        self._mm = q8_matmul if kernel_available() else q8_matmul_reference
        #: the codes are also the model's input embedding (a tied lm_head; set by the GGUF loader)
        self.tied_embedding = False

    @classmethod
    def concat(cls, parts: list[Int8Linear]) -> Int8Linear:
        """One layer whose output rows are ``parts``' rows in order (their outputs side by side;
        each output column is computed alone, so a fused column equals the part's bit for bit).
        All parts must share ``in_features``, ``group_size``, whether they have zeros and a bias."""
        biases = [p.bias for p in parts]
        bias = None if biases[0] is None else torch.cat([b for b in biases if b is not None])
        zeros = [p.zeros for p in parts if p.zeros is not None]
        with amx_int8.enabled(parts[0].amx):  # the parts' kernel, whatever the caller's block
            return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), bias,
                       parts[0].scheme, torch.cat(zeros) if zeros else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        buffers: dict[str, torch.Tensor] = self._buffers  # type: ignore[assignment]  # all registered
        if self.amx and x2.dtype == torch.bfloat16:  # every row count (faster than the GEMM path too)
            plan = current_row_plan() if self.prompt_tiles else None
            if plan is not None and plan.num_tokens == x2.shape[0]:
                return self._mixed_rows(x2.contiguous(), plan, x.dtype).reshape(*lead, self.out_features)
            y = amx_int8.amx_int8_mm(x2, buffers["codes"], buffers["amx_scales"], buffers.get("amx_sub"),
                                     self.six_bit)
            return self._finish(y, x.dtype, lead)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        sub = buffers["sub_scales"]
        if sub is not None and x2.shape[0] < GEMM_ROWS:
            y = q8_matmul_split(x2, buffers["codes"], sub, buffers["block_scales"], _isa())
        else:
            mm = self._mm if x2.shape[0] < GEMM_ROWS else q8_matmul_reference
            y = mm(x2, buffers["codes"], buffers["scales"], buffers["zeros"])
        return self._finish(y, x.dtype, lead)

    def _mixed_rows(self, x2: torch.Tensor, plan: RowPlan, dtype: torch.dtype) -> torch.Tensor:
        """The plan's dense rows (prompt tokens) through :func:`~proxy.quant.amx_int8.amx_int8_prompt_mm`,
        the others through the kernel, each finished as alone: ``[T, out_features]`` in ``dtype``."""
        b: dict[str, torch.Tensor] = self._buffers  # type: ignore[assignment]  # all registered
        codes, scales, sub, six = b["codes"], b["amx_scales"], b.get("amx_sub"), self.six_bit
        yd = amx_int8.amx_int8_prompt_mm(dense_rows_of(x2, plan), codes, scales, sub)
        return merge_rows(plan, self._finish(yd, dtype, yd.shape[:1]), x2, lambda x: self._finish(
            amx_int8.amx_int8_mm(x, codes, scales, sub, six), dtype, x.shape[:1]))

    def _finish(self, y: torch.Tensor, dtype: torch.dtype, lead: torch.Size) -> torch.Tensor:
        """The fp32 product ``y`` plus the bias (in fp32), rounded once to ``dtype``, shaped ``lead``."""
        bias = self.bias
        if bias is not None:
            y += bias
        if y.dtype != dtype:
            y = y.to(dtype)
        return y.view(*lead, self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight ``[out_features, in_features]``: ``codes * scales`` (exact), ``+ zeros`` (one
        rounding)."""
        w = self.codes.view(self.out_features, -1, self.group_size).float() * self.scales[..., None]
        if self.zeros is not None:
            w += self.zeros[..., None]
        return w.view(self.out_features, self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}, "
                f"group_size={self.group_size}, kernel={'amx' if self.amx else 'q8'}")
