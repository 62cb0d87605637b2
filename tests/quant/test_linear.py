"""proxy.quant.linear / kernels / apply: packed int4 planes, int8 as two nibble planes, PackedLinear
against a dense reference, swapping a model's linears, the CPU flag rules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from proxy.quant import kernels
from proxy.quant.apply import describe, quantize_linears
from proxy.quant.linear import (
    Int4Plane,
    PackedLinear,
    int8_planes,
    kernel_view,
    quantize_int4,
    quantize_int8,
)

CPU = torch.device("cpu")


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1


def test_fp32_kernel_computes_planes_values_exactly() -> None:
    """The kernel's dequantization (an identity matmul) equals ``(code - 8) * scale + zero`` bit for bit."""
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (32, 64), generator=g, dtype=torch.uint8)
    scale = torch.rand(32, 2, generator=g) * 0.01
    zero = torch.randn(32, 2, generator=g) * 0.01
    plane = Int4Plane(codes, scale, zero)
    layer = PackedLinear([plane], None, 32, CPU, torch.float32, "t")
    assert torch.equal(layer.dequantize(), plane.dequantize(32))
    expected = (codes.double() - 8) * scale.double().repeat_interleave(
        32, 1
    ) + zero.double().repeat_interleave(32, 1)
    assert torch.equal(plane.dequantize(32), expected.float())


def test_int8_planes_sum_to_d_times_q_exactly() -> None:
    q = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8).reshape(16, 16).repeat(1, 2)  # every code
    d = torch.tensor([[0.013671875]] * 16)  # an fp16 value
    planes = int8_planes(q, d)
    assert [int(p.codes.max()) for p in planes] == [15, 15] and [int(p.codes.min()) for p in planes] == [0, 0]
    total = planes[0].dequantize(32) + planes[1].dequantize(32)
    assert torch.equal(total, q.float() * d)
    layer = PackedLinear(planes, None, 32, CPU, torch.float32, "t")
    assert torch.equal(layer.dequantize(), q.float() * d)


def _gguf_like_planes(n: int, k: int, seed: int, int8: bool) -> list[Int4Plane]:
    """Planes as GGUF blocks decode: fp16 scales (Q4_1's zero m + 8 d; Q8_0 as two nibble planes)."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
    if int8:
        return int8_planes(torch.randint(-128, 128, (n, k), generator=g).to(torch.int8), d)
    m = (torch.randn(n, k // 32, generator=g) * 0.05).half().float()
    return [Int4Plane(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), d, m + 8.0 * d)]


@pytest.mark.parametrize("int8", [False, True])
def test_fp32_ops_equal_the_float64_path_for_fp16_scales(int8) -> None:
    for p in _gguf_like_planes(576, 576, 3, int8):
        assert torch.equal(p.dequantize_exact_products(32), p.dequantize(32))


@pytest.mark.parametrize("kernel_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("int8", [False, True])
def test_kernel_view_equals_the_identity_matmul(kernel_dtype, int8) -> None:
    """The dense copy made from the planes (milliseconds) is the kernel's own view of the weight
    (a [K, K] identity matmul through it), bit for bit; a layer built with a dense dtype holds it,
    and concatenated siblings hold theirs side by side."""
    parts = []
    for seed, n in enumerate((192, 576)):
        planes = _gguf_like_planes(n, 576, seed, int8)
        layer = PackedLinear(planes, None, 32, CPU, kernel_dtype, "t", dense_dtype=torch.float32)
        view = kernel_view(planes, 32, kernel_dtype)
        assert view.dtype == kernel_dtype and torch.equal(view, layer.dequantize())
        if kernel_dtype == torch.bfloat16:
            assert layer.dense_weight is not None and torch.equal(layer.dense_weight, view)
            assert layer.dense_dtype == torch.float32
        else:
            assert layer.dense_weight is None  # dense copies are for bf16 kernels only
        parts.append(layer)
    fused = PackedLinear.concat(parts)
    if kernel_dtype == torch.bfloat16:
        assert fused.dense_weight is not None and torch.equal(fused.dense_weight, fused.dequantize())
    else:
        assert fused.dense_weight is None


@pytest.mark.parametrize(("quantize", "bound"), [(quantize_int4, 0.5 / 15), (quantize_int8, 0.5 / 127)])
def test_quantize_error_is_within_half_a_step(quantize, bound) -> None:
    w = _weight(48, 96)
    planes = quantize(w, 32)
    value = sum(p.dequantize(32) for p in planes)
    groups = w.reshape(48, 3, 32)
    span = (groups.amax(2) - groups.amin(2)) if quantize is quantize_int4 else 2 * groups.abs().amax(2)
    err = (value - w).abs().reshape(48, 3, 32).amax(2)
    assert (err <= span * bound * (1 + 1e-5) + 1e-7).all()
    assert err.max() > 0  # it did quantize


@pytest.mark.parametrize("method", ["int4", "int8"])
@pytest.mark.parametrize("kernel_dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_matches_dense_of_its_own_weights(method, kernel_dtype) -> None:
    """``PackedLinear(x)`` == ``x @ dequant(W).T + b`` (shapes [2, 3, K] in, [2, 3, N] out, input dtype
    kept)."""
    w, b = _weight(64, 96), torch.randn(64) * 0.1
    planes = (quantize_int4 if method == "int4" else quantize_int8)(w, 32)
    layer = PackedLinear(planes, b, 32, CPU, kernel_dtype, method)
    x = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(2))
    y = layer(x)
    assert y.shape == (2, 3, 64) and y.dtype == torch.float32
    dense = sum(p.dequantize(32) for p in planes)
    ref = x @ dense.t() + b
    tol = 1e-5 if kernel_dtype == torch.float32 else 3e-2
    assert torch.allclose(y, ref, atol=tol, rtol=tol), (y - ref).abs().max()
    # each row of a batch is computed as it would be alone (batch invariance of the kernel)
    alone = torch.stack([layer(x.reshape(6, 96)[i:i + 1]) for i in range(6)]).reshape(2, 3, 64)
    assert torch.equal(alone, y)
    assert layer(x[:0]).shape == (0, 3, 64)
    # a strided view (generate() takes hidden_states[:, -1:, :] for the head) is served too
    last = x[:, -1:, :]
    assert not last.reshape(-1, 96).is_contiguous()
    assert torch.equal(layer(last), y[:, -1:, :])


def test_unsupported_shapes_are_refused_with_the_reason() -> None:
    assert "multiple of 16" in kernels.supports_shape(97, 64, 32, CPU)
    assert "group size" in kernels.supports_shape(96, 48, 32, CPU)
    assert kernels.supports_shape(96, 64, 32, CPU) is None
    assert "not one of" in kernels.supports_shape(64, 96, 48, torch.device("cuda"))
    with pytest.raises(ValueError, match="multiple of 16"):
        PackedLinear(quantize_int4(_weight(40, 64), 32), None, 32, CPU, torch.float32, "t")


def test_kernel_dtype_follows_the_cpu_flags(monkeypatch) -> None:
    kernels.cpu_flags.cache_clear()
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "amx_bf16"}))
    assert kernels.cpu_bf16_flags() == ["amx_bf16"]
    assert kernels.kernel_dtype(CPU) == torch.bfloat16 and kernels.is_fast(CPU)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert kernels.cpu_bf16_flags() == []
    assert kernels.kernel_dtype(CPU) == torch.bfloat16  # widened in registers: 20x the fp32 kernel
    assert kernels.is_fast(CPU)  # auto packs; prompt tokens take dense fp32 copies (dense_prefill)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"sse4_2"}))
    assert kernels.kernel_dtype(CPU) == torch.float32 and not kernels.is_fast(CPU)
    assert kernels.kernel_dtype(torch.device("cuda")) == torch.bfloat16


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = type("C", (), {"tie_word_embeddings": True})()
        self.embed = nn.Embedding(32, 64)
        self.proj = nn.Linear(64, 64)
        self.odd = nn.Linear(64, 40)  # N not a multiple of 16: stays dense
        self.head = nn.Linear(64, 32, bias=False)
        self.head.weight = self.embed.weight

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.head


def test_quantize_linears_swaps_linears_unties_head_and_keeps_embedding_dense() -> None:
    torch.manual_seed(0)
    model = _Tied()
    embed_before = model.embed.weight.detach().clone()
    counts = quantize_linears(model, "int4", 32, torch.float32)
    assert counts == {"int4 g32": 2, "dense": 1}
    assert describe(counts) == "int4 g32 x2, dense x1"
    assert isinstance(model.proj, PackedLinear) and isinstance(model.head, PackedLinear)
    assert type(model.odd) is nn.Linear and type(model.embed) is nn.Embedding
    assert torch.equal(model.embed.weight, embed_before)
    assert model.config.tie_word_embeddings is False
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_linears(_Tied(), "int3", 32, torch.float32)
