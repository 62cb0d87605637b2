"""The Q8_0 kernel (``ext/kernels/q8_matmul.h``; groups of 32, and of 16 for Q6_K) and
:class:`proxy.quant.int8_linear.Int8Linear`."""

from __future__ import annotations

import os

import pytest
import torch

from proxy.quant import amx_int8, int8_linear
from proxy.quant.int8_linear import Int8Linear, kernel_available, q8_matmul, q8_matmul_reference
from proxy.quant.kernels import cpu_flags
from tests.quant.invariance import assert_rows_and_threads_invariant

needs_kernel = pytest.mark.skipif(
    not kernel_available(), reason="the Q8_0 kernel needs x86-64 with AVX2 and FMA"
)


def _weights(n: int, k: int, seed: int = 0, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes and scales: group 32 as ``Q8_0`` (fp16 ``d``), 16 as ``Q6_K`` (6-bit codes,
    ``d * scale`` with an int8 scale)."""
    g = torch.Generator().manual_seed(seed)
    if group == 16:
        codes = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g)
        sub = torch.randint(-128, 128, (n, k // 16), generator=g).float()
        return codes, (torch.rand(n, k // 256 + 1, generator=g) * 1e-3).half().float()[:, :1] * sub
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scales = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()  # GGUF's fp16 d, widened
    return codes, scales


def test_the_kernel_is_built_where_ci_requires_it() -> None:
    if os.environ.get("STREAMPROXY_REQUIRE_COMPILED") != "1":
        pytest.skip("STREAMPROXY_REQUIRE_COMPILED is not set")
    assert int8_linear.KERNEL_IMPORT_ERROR is None
    assert kernel_available() == ({"avx2", "fma"} <= cpu_flags())
    want = [name for name, flag in (("avx2", "avx2"), ("avx512", "avx512f")) if flag in cpu_flags()]
    assert int8_linear.supported_isas() == want
    assert int8_linear.KERNEL_ISA == (want[-1] if want else None)


@needs_kernel
def test_an_isa_this_cpu_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match="does not run 'sse'"):
        int8_linear.set_kernel_isa("sse")


@needs_kernel
@pytest.mark.parametrize("group", [32, 16])
@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 5, 32), (7, 100, 96), (8, 33, 576), (9, 64, 64), (33, 17, 160)]
)
def test_kernel_equals_the_torch_reference(m: int, n: int, k: int, group: int, isa: str) -> None:
    codes, scales = _weights(n, k, group=group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    got = q8_matmul(x, codes, scales)
    want = x.double() @ (codes.double().view(n, -1, group) * scales.double()[..., None]).view(n, k).t()
    assert got.dtype == torch.float32 and got.shape == (m, n)
    bound = 1e-6 * (x.double().abs() @ codes.double().abs().t() * scales.double().max()).max().item()
    assert (got.double() - want).abs().max().item() <= bound
    assert (q8_matmul_reference(x, codes, scales).double() - want).abs().max().item() <= bound


@needs_kernel
@pytest.mark.parametrize("group", [32, 16])
def test_unit_rows_give_the_gguf_values_exactly(group: int, isa: str) -> None:
    """``e_k @ W.T`` is column ``k`` of ``codes * scales``, each product exact in fp32; with groups of
    16 each half of a 32-input step takes its own scale."""
    codes, scales = _weights(48, 64, group=group)
    got = q8_matmul(torch.eye(64), codes, scales)
    layer = Int8Linear(codes, scales, None)
    assert layer.group_size == group
    want = (codes.float().view(48, -1, group) * scales[..., None]).view(48, 64)
    assert torch.equal(got.t(), want) and torch.equal(layer.dequantize(), want)


@needs_kernel
def test_zeros_are_added_to_the_exact_products(isa: str) -> None:
    """``Q5_1`` / ``Q5_K``: ``W = codes * scales + zeros``, the exact product plus the zero rounded
    once (gguf's ``d * q + m``); unit rows give it exactly, a row's bits do not depend on the batch."""
    codes, scales = _weights(48, 96)
    codes = codes.abs().clamp(max=31)  # 5-bit codes
    zeros = -(torch.rand(48, 3, generator=torch.Generator().manual_seed(4)) * 0.3).half().float()
    layer = Int8Linear(codes, scales, None, "Q5_1 as int8 g32", zeros)
    want = (codes.double().view(48, 3, 32) * scales.double()[..., None] + zeros.double()[..., None]).float()
    assert torch.equal(layer.dequantize(), want.view(48, 96))
    assert torch.equal(q8_matmul(torch.eye(96), codes, scales, zeros).t(), want.view(48, 96))
    x = torch.randn(19, 96, generator=torch.Generator().manual_seed(5))
    whole = layer(x)
    assert torch.equal(layer(x[7:8]), whole[7:8]) and torch.equal(layer(x[2:19]), whole[2:19])
    ref = q8_matmul_reference(x, codes, scales, zeros).double()
    assert (whole.double() - ref).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="zeros shaped as the scales"):
        Int8Linear(codes, scales, None, "x", zeros[:, :1])


@needs_kernel
@pytest.mark.parametrize("group", [32, 16])
def test_a_rows_bits_do_not_depend_on_the_batch_or_the_threads(group: int, isa: str) -> None:
    codes, scales = _weights(203, 576, group=group)  # 203: one row takes 4 weight rows at a time, then 3
    x = torch.randn(19, 576, generator=torch.Generator().manual_seed(2))
    whole = q8_matmul(x, codes, scales)
    # tiles: 8 rows (AVX2), 16 (AVX-512); the tail
    rows = [slice(i, i + 1) for i in (0, 7, 8, 15, 16, 18)] + [slice(3, 12), slice(2, 19)]
    assert_rows_and_threads_invariant(lambda xs: q8_matmul(xs, codes, scales), x, whole, rows)


@needs_kernel
@pytest.mark.parametrize("k", [1024, 4096])
def test_padded_and_blocked_calls_keep_a_rows_bits(k: int, isa: str) -> None:
    """K = 1024 and 4096: rows 4 KiB apart (read from a padded copy), and at 4096 more than 4 rows
    take the loop blocked over K (AVX-512); a row's bits are those it has alone."""
    codes, scales = _weights(40, k, group=16)
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([q8_matmul(x[i:i + 1], codes, scales) for i in range(19)])
    for rows in (slice(0, 5), slice(0, 8), slice(2, 18), slice(0, 19)):
        assert torch.equal(q8_matmul(x[rows], codes, scales), alone[rows])
    want = x.double() @ (codes.double().view(40, -1, 16) * scales.double()[..., None]).view(40, k).t()
    bound = 1e-6 * (x.double().abs() @ codes.double().abs().t() * scales.double().abs().max()).max().item()
    assert (alone.double() - want).abs().max().item() <= bound


@needs_kernel
def test_empty_and_non_contiguous_inputs(isa: str) -> None:
    codes, scales = _weights(16, 64)
    assert q8_matmul(torch.empty(0, 64), codes, scales).shape == (0, 16)
    x = torch.randn(64, 6)[:, ::2].t()  # [3, 64], not contiguous
    assert not x.is_contiguous()
    assert torch.equal(q8_matmul(x, codes, scales), q8_matmul(x.contiguous(), codes, scales))


def test_arguments_that_do_not_fit_are_refused() -> None:
    codes, scales = _weights(16, 64)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="fp32 x"):
        q8_matmul(x.double(), codes, scales)
    with pytest.raises(ValueError, match="shapes do not fit"):
        q8_matmul(torch.randn(2, 32), codes, scales)
    with pytest.raises(ValueError, match="shapes do not fit"):
        q8_matmul(torch.randn(2, 48), torch.zeros(16, 48, dtype=torch.int8), torch.zeros(16, 1))
    with pytest.raises(ValueError, match="a scale per 32 or 16 inputs"):  # groups of 8
        q8_matmul(x, codes, torch.zeros(16, 8))
    with pytest.raises(ValueError, match="contiguous"):
        q8_matmul(x, torch.zeros(64, 16, dtype=torch.int8).t(), scales)
    with pytest.raises(ValueError, match="fp32 x"):
        Int8Linear(codes, scales.half(), None)


@pytest.mark.parametrize("kernel", [True, False])
def test_int8_linear_forward(kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if kernel and not kernel_available():
        pytest.skip("the Q8_0 kernel needs x86-64 with AVX2 and FMA")
    if not kernel:
        monkeypatch.setattr(int8_linear, "kernel_available", lambda: False)
    codes, scales = _weights(40, 96)
    bias = torch.randn(40)
    with amx_int8.enabled(False):  # bf16 calls would take the AMX int8 kernel (tests/quant/test_amx_int8.py)
        layer = Int8Linear(codes, scales, bias)
    assert layer._mm is (q8_matmul if kernel else q8_matmul_reference)
    x = torch.randn(2, 3, 96)
    want = x @ layer.dequantize().t() + bias
    y = layer(x)
    assert y.shape == (2, 3, 40) and y.dtype == torch.float32
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-5)
    yb = layer(x.bfloat16())  # computed in fp32, rounded once to the input's dtype
    assert yb.dtype == torch.bfloat16
    assert torch.equal(yb, (layer._mm(x.bfloat16().float().view(6, 96), codes, scales) + bias)
                       .bfloat16().view(2, 3, 40))
    assert "Q8_0 as int8 g32" in repr(layer)


@needs_kernel
def test_the_op_is_registered_for_torch_compile() -> None:
    codes, scales = _weights(16, 64)
    assert int8_linear._q8_matmul is not None and int8_linear.KERNEL_ISA is not None
    isa = int8_linear._q8_matmul.ISAS[int8_linear.KERNEL_ISA]
    op = torch.ops.streamproxy.q8_matmul.default
    for zeros in (None, torch.rand(16, 2)):
        torch.library.opcheck(op, (torch.randn(3, 64), codes, scales, zeros, isa),
                              test_utils=("test_schema", "test_faketensor"))


@needs_kernel
def test_calls_of_many_rows_take_the_dequantized_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    codes, scales = _weights(32, 64)
    layer = Int8Linear(codes, scales, None)
    calls: list[int] = []
    real = int8_linear.q8_matmul_reference

    def spy(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, c, s, z)

    monkeypatch.setattr(int8_linear, "q8_matmul_reference", spy)
    x = torch.randn(int8_linear.GEMM_ROWS, 64)
    y = layer(x)
    assert calls == [int8_linear.GEMM_ROWS]
    assert torch.equal(y, real(x, codes, scales))
    layer(x[:-1])  # one row fewer: the kernel
    assert calls == [int8_linear.GEMM_ROWS]
