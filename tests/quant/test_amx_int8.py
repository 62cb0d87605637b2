"""The AMX int8 kernel (``ext/kernels/amx_int8.h``), its scale layout, and :class:`Int8Linear` on it."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from proxy.quant import amx_int8
from proxy.quant.gguf_types import int8_codes
from proxy.quant.int8_linear import GEMM_ROWS, Int8Linear
from proxy.quant.kernels import cpu_flags
from tests.quant.invariance import PROMPT_ROWS, assert_rows_and_threads_invariant
from tests.quant.test_gguf_types import random_blocks

CPU = torch.device("cpu")
T = gguf.GGMLQuantizationType
needs_kernel = pytest.mark.skipif(
    not amx_int8.kernel_available(), reason="the AMX int8 kernel needs AMX-BF16 (Intel Sapphire Rapids+)"
)


def _weights(n: int, k: int, group: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes and scales: group 32 as ``Q8_0`` (int8 codes, fp16 ``d``), 16 as ``Q6_K`` (6-bit
    codes, ``d * scale`` with an int8 scale per 16 and an fp16 ``d`` per 256)."""
    g = torch.Generator().manual_seed(seed)
    if group == 16:
        codes = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g)
        sub = torch.randint(-128, 128, (n, k // 16), generator=g).float()
        d = (torch.rand(n, k // 256, generator=g) * 1e-3 + 1e-4).half().float()
        return codes, d.repeat_interleave(16, dim=1) * sub
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    return codes, (torch.rand(n, k // 32, generator=g) * 0.02).half().float()


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    packed, sub, six_bit = amx_int8.pack(codes, scales)
    return amx_int8.amx_int8_mm(x, codes, packed, sub, six_bit)


def _exact(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    return (codes.float().view(n, scales.shape[1], -1) * scales[..., None]).view(n, k)


def test_the_kernel_is_built_where_ci_requires_it() -> None:
    if os.environ.get("STREAMPROXY_REQUIRE_COMPILED") != "1":
        pytest.skip("STREAMPROXY_REQUIRE_COMPILED is not set")
    assert amx_int8.KERNEL_IMPORT_ERROR is None


def test_availability_follows_the_cpu_flags() -> None:
    if amx_int8.kernel_available():
        assert {"amx_bf16", "amx_tile", "avx512bw"} <= cpu_flags()
    if not {"amx_bf16", "amx_tile"} <= cpu_flags():
        assert not amx_int8.kernel_available()


@pytest.mark.parametrize("group", [32, 16])
def test_pack_tiles_the_scales_and_unpack_inverts_it(group: int) -> None:
    codes, scales = _weights(48, 512, group)
    packed, sub, six_bit = amx_int8.pack(codes, scales)
    assert six_bit is (group == 16)  # Q6_K's codes fit 6 bits, Q8_0's random ones do not
    if group == 16:  # split as Q6_K stores them: fp32 d per 256, int8 scale per 16
        assert sub is not None and sub.dtype == torch.int8 and sub.shape == (3, 32, 16)
        assert packed.shape == (3, 2, 16) and packed.dtype == torch.float32
        assert float(packed[2, 1, 5]) * int(sub[2, 20, 5]) == float(scales[37, 20])
    else:
        assert sub is None and packed.shape == (3, 16, 16)
        assert float(packed[1, 7, 9]) == float(scales[25, 7])
    assert torch.equal(amx_int8.unpack_scales(packed, sub), scales)
    if group == 16:  # a scale far from its block's: no exact split, the fp32 scales tiled
        unsplit = scales.clone()
        unsplit[0, 0] = 1e-30
        packed, sub, _ = amx_int8.pack(codes, unsplit)
        assert sub is None and packed.shape == (3, 32, 16)
        assert torch.equal(amx_int8.unpack_scales(packed, sub), unsplit)


def test_why_not_names_the_reason() -> None:
    assert "zeros" in (amx_int8.why_not(32, 64, 32, True, CPU) or "")
    assert "groups of 16 or 32" in (amx_int8.why_not(32, 64, 64, False, CPU) or "")
    assert "N % 16" in (amx_int8.why_not(40, 64, 32, False, CPU) or "")
    with amx_int8.enabled(False):
        assert "turned off" in (amx_int8.why_not(32, 64, 32, False, CPU) or "")


@needs_kernel
@pytest.mark.parametrize(("group", "split"), [(32, False), (16, True), (16, False)])
def test_a_unit_vector_gives_the_weight_exactly(group: int, split: bool) -> None:
    codes, scales = _weights(64, 512, group)
    if not split and group == 16:
        scales[0, 0] = 1e-30  # fp32 scales per 16, not split
    got = _mm(torch.eye(512, dtype=torch.bfloat16), codes, scales)
    assert torch.equal(got.t(), _exact(codes, scales))


@needs_kernel
@pytest.mark.parametrize("group", [32, 16])
def test_exact_sums_are_the_same_bits_as_the_exact_reference(group: int) -> None:
    """Small integer activations and scales of few significant bits: every partial sum the kernel
    forms is exact in fp32, in any order, so its output equals the fp64 product bit for bit."""
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(-128, 128, (80, 768), dtype=torch.int8, generator=g)
    scales = torch.randint(1, 16, (80, 768 // group), generator=g).float() * 2.0 ** -10
    x = torch.randint(-4, 5, (19, 768), generator=g).bfloat16()
    want = amx_int8.amx_int8_mm_reference(x, codes, *amx_int8.pack(codes, scales)[:2])
    assert torch.equal(want.double(), x.double() @ _exact(codes, scales).double().t())
    assert torch.equal(_mm(x, codes, scales), want)


@needs_kernel
@pytest.mark.parametrize("group", [32, 16])
def test_the_kernel_matches_its_reference(group: int) -> None:
    codes, scales = _weights(96, 1024, group)
    x = _x(37, 1024)
    got = _mm(x, codes, scales).double()
    want = amx_int8.amx_int8_mm_reference(x, codes, *amx_int8.pack(codes, scales)[:2]).double()
    # fp32 sums of 1024 terms in another order: within a few fp32 steps of the sum of magnitudes
    bound = 2.0 ** -20 * (x.double().abs() @ _exact(codes, scales).double().abs().t())
    assert bool(((got - want).abs() <= bound).all())


@needs_kernel
@pytest.mark.parametrize("group", [32, 16])
def test_a_row_is_the_same_bits_in_any_batch_and_at_any_thread_count(group: int) -> None:
    codes, scales = _weights(80, 512, group)
    x = _x(49, 512)
    full = _mm(x, codes, scales)
    rows = [slice(0, m) for m in (1, 2, 3, 15, 16, 17, 31, 33, 48)] + [slice(20, 21)]
    assert_rows_and_threads_invariant(lambda xs: _mm(xs, codes, scales), x, full, rows)


@needs_kernel
def test_the_six_bit_widening_gives_the_same_bits() -> None:
    codes, scales = _weights(32, 512, 16)
    packed, sub, six_bit = amx_int8.pack(codes, scales)
    assert six_bit
    x = _x(5, 512)
    assert torch.equal(amx_int8.amx_int8_mm(x, codes, packed, sub, True),
                       amx_int8.amx_int8_mm(x, codes, packed, sub, False))


@needs_kernel
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q6_K, T.IQ4_XS, T.Q5_0])
def test_gguf_types_give_gguf_dequantize_exactly(qtype: T) -> None:
    shape = (32, 512)
    if qtype in (T.Q8_0, T.Q5_0):  # gguf-py quantizes these
        raw = quantize(np.random.default_rng(3).standard_normal(shape).astype(np.float32) * 0.05, qtype)
    else:
        raw = random_blocks(qtype, *shape, seed=3)
    codes, scales, zeros = int8_codes(qtype.name, raw, shape)
    assert zeros is None
    layer = Int8Linear(codes, scales, None, qtype.name)
    assert layer.amx and "kernel=amx" in repr(layer)
    want = torch.from_numpy(dequantize(raw, qtype).reshape(shape))
    assert torch.equal(layer.dequantize(), want)
    unit = amx_int8.amx_int8_mm(torch.eye(512, dtype=torch.bfloat16), layer.codes, layer.amx_scales,
                                layer.amx_sub, layer.six_bit)
    assert torch.equal(unit.t(), want)


@needs_kernel
def test_an_int8_linear_takes_the_kernel_for_bf16_calls() -> None:
    codes, scales = _weights(64, 512, 16)
    bias = torch.randn(64)
    layer = Int8Linear(codes, scales, bias, "Q6_K as int8 g16")
    assert layer.amx and layer.sub_scales is None  # the AMX layout replaces the int8 kernel's split
    x = _x(6, 512)
    want = (_mm(x, codes, scales) + bias).bfloat16()
    assert torch.equal(layer(x), want)
    assert torch.equal(layer(x[2:3]), want[2:3])
    fused = Int8Linear.concat([layer, layer])
    assert fused.amx and torch.equal(fused(x)[:, 64:], want)
    many = _x(GEMM_ROWS + 5, 512)  # a prompt's chunk takes the kernel too: a row's bits as alone
    assert torch.equal(layer(many)[GEMM_ROWS:], layer(many[GEMM_ROWS:]))
    assert torch.equal(layer(many)[3:4], layer(many[3:4]))
    with amx_int8.enabled(False):
        assert not Int8Linear(codes, scales, None).amx
        assert not Int8Linear.concat([Int8Linear(codes, scales, None)] * 2).amx
    with_zeros = Int8Linear(codes, scales, None, zeros=torch.zeros_like(scales))
    assert not with_zeros.amx


@needs_kernel
def test_the_op_is_registered_for_torch_compile() -> None:
    for group in (32, 16):
        codes, scales = _weights(16, 256, group)
        packed, sub, six_bit = amx_int8.pack(codes, scales)
        torch.library.opcheck(torch.ops.streamproxy.amx_int8_mm.default,
                              (_x(3, 256), codes, packed, sub, group, six_bit),
                              test_utils=("test_schema", "test_faketensor"))


@needs_kernel
def test_arguments_that_do_not_fit_are_refused() -> None:
    codes, scales = _weights(32, 256, 32)
    packed, sub, six_bit = amx_int8.pack(codes, scales)
    with pytest.raises(RuntimeError):
        amx_int8.amx_int8_mm(_x(2, 256).float(), codes, packed, sub, six_bit)
    with pytest.raises(RuntimeError):
        amx_int8.amx_int8_mm(_x(2, 224), codes, packed, sub, six_bit)
    assert amx_int8.amx_int8_mm(_x(0, 256), codes, packed, sub, six_bit).shape == (0, 32)


@needs_kernel
@pytest.mark.parametrize(("n", "k", "group", "split"), [(48, 512, 32, False), (64, 512, 16, True),
                                                        (32, 256, 16, False), (16, 4096, 16, True)])
def test_the_prompt_row_kernel_computes_bf16_weights_and_a_rows_bits_alone(n: int, k: int, group: int,
                                                                           split: bool) -> None:
    """``amx_int8_prompt_mm``: unit vectors give ``bf16(code * scale)``; rows agree with the bf16
    weight's product; a row's bits do not depend on the other rows, the row count or the threads."""
    codes, scales = _weights(n, k, group, seed=n + k)
    packed, sub, _ = amx_int8.pack(codes, scales)
    if not split and sub is not None:  # the same scales, not split
        packed, sub = amx_int8._tiled(scales), None
    assert (sub is not None) == split
    weight = _exact(codes, scales).bfloat16()  # [N, K]
    eye = torch.eye(k, dtype=torch.bfloat16)[:256]
    assert torch.equal(amx_int8.amx_int8_prompt_mm(eye, codes, packed, sub), weight[:, :256].t().float())
    x = _x(70, k, seed=k)
    y = amx_int8.amx_int8_prompt_mm(x, codes, packed, sub)
    want = x.float() @ weight.float().t()
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4 * float(y.abs().max()))
    assert_rows_and_threads_invariant(lambda xs: amx_int8.amx_int8_prompt_mm(xs, codes, packed, sub), x, y,
                                      PROMPT_ROWS)


@needs_kernel
def test_an_int8_layer_with_prompt_tiles_takes_the_prompt_kernel_for_the_plans_dense_rows() -> None:
    from proxy.quant.dense_prefill import active_row_plan, plan_rows

    codes, scales = _weights(64, 512, 16)
    bias = torch.randn(64)
    layer = Int8Linear(codes, scales, bias, "Q6_K as int8 g16")
    layer.prompt_tiles = True
    x = _x(30, 512)
    positions = torch.cat([torch.tensor([400, 90]), torch.arange(0, 20), torch.arange(50, 58)])
    dense = torch.tensor([False, False] + [True] * 28)
    with active_row_plan(plan_rows(positions, dense, by_position=False)):
        y = layer(x)
    buffers = layer._buffers
    prompt = amx_int8.amx_int8_prompt_mm(x[2:], codes, buffers["amx_scales"], buffers.get("amx_sub"))
    assert torch.equal(y[2:], (prompt + bias).bfloat16())
    assert torch.equal(y[:2], layer(x[:2]))  # the decodes: the kernel's bits, as alone
    assert not torch.equal(y[2:], layer(x[2:]))  # prompt rows are their own kind
