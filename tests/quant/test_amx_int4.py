"""The AMX int4 kernel (``ext/kernels/amx_int4.h``), its layout, and :class:`PackedLinear` on it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from proxy.quant import amx_int4
from proxy.quant.kernels import cpu_flags
from proxy.quant.linear import Int4Plane, PackedLinear, kernel_view, quantize_int4
from tests.quant.invariance import PROMPT_ROWS, assert_rows_and_threads_invariant

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(
    not amx_int4.amx_available(), reason="the AMX int4 kernel needs AMX-BF16 (Intel Sapphire Rapids+)"
)


@pytest.fixture
def torch_kernel() -> Iterator[None]:
    """Layers built inside take torch's int4 kernel; the process's choice restored after."""
    with amx_int4.enabled(False):
        yield


def _plane(n: int, k: int, group: int, seed: int = 0) -> Int4Plane:
    g = torch.Generator().manual_seed(seed)
    (plane,) = quantize_int4(torch.randn(n, k, generator=g), group)
    return plane


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_the_kernel_is_built_where_ci_requires_it() -> None:
    if os.environ.get("STREAMPROXY_REQUIRE_COMPILED") != "1":
        pytest.skip("STREAMPROXY_REQUIRE_COMPILED is not set")
    assert amx_int4.KERNEL_IMPORT_ERROR is None


def test_availability_follows_the_cpu_flags() -> None:
    if amx_int4.amx_available():
        assert {"amx_bf16", "amx_tile", "avx512bw"} <= cpu_flags()
    if not {"amx_bf16", "amx_tile"} <= cpu_flags():
        assert not amx_int4.amx_available()


def test_pack_and_unpack_are_inverse() -> None:
    plane = _plane(48, 128, 32)
    tiles, sz = amx_int4.pack(plane.codes, plane.scale, plane.zero)
    assert tiles.shape == (3, 4, 256) and tiles.dtype == torch.uint8
    assert sz.shape == (2, 3, 4, 16) and sz.dtype == torch.bfloat16
    assert torch.equal(amx_int4.unpack_codes(tiles), plane.codes)
    # B-tile row r element i of tile (b, t) is W[16 b + i / 2, 32 t + 2 r + i % 2]; the 16-bit word i of
    # the tile's 64 bytes q holds rows 4q .. 4q + 3 of element i, lowest nibble first
    b, t, r, i = 2, 3, 6, 9
    byte = int(tiles[b, t, 64 * (r // 4) + 2 * i + (r % 4) // 2])
    code = byte >> 4 if r % 2 else byte & 15
    assert code == int(plane.codes[16 * b + i // 2, 32 * t + 2 * r + i % 2])
    assert float(sz[1, b, t, 7]) == float(plane.zero[16 * b + 7, t].bfloat16())


def test_the_reference_computes_with_the_planes_unrounded_values() -> None:
    # weights (code - 8) * scale + zero with bf16 scales and zeros, not rounded to bf16 themselves
    plane = _plane(32, 192, 64)
    tiles, sz = amx_int4.pack(plane.codes, plane.scale, plane.zero)
    x = _x(5, 192)
    rounded = Int4Plane(plane.codes, plane.scale.bfloat16().float(), plane.zero.bfloat16().float())
    exact = x.double() @ rounded.dequantize(64).double().t()
    got = amx_int4.amx_int4_mm_reference(x, tiles, sz, 64).double()
    assert bool(((got - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-4).all())


def test_why_not_names_the_reason() -> None:
    assert "one-plane" in (amx_int4.why_not(32, 64, 32, 2, CPU, torch.bfloat16) or "")
    assert "one-plane" in (amx_int4.why_not(32, 64, 32, 1, CPU, torch.float32) or "")
    assert "group" in (amx_int4.why_not(32, 64, 16, 1, CPU, torch.bfloat16) or "")
    assert "N % 16" in (amx_int4.why_not(40, 64, 32, 1, CPU, torch.bfloat16) or "")


@needs_kernel
@pytest.mark.parametrize("group", [32, 64, 128])
def test_a_unit_vector_gives_the_dense_copys_weight_exactly(group: int) -> None:
    plane = _plane(64, 256, group)
    tiles, sz = amx_int4.pack(plane.codes, plane.scale, plane.zero)
    got = amx_int4.amx_int4_mm(torch.eye(256, dtype=torch.bfloat16), tiles, sz, group)
    assert torch.equal(got.t(), kernel_view([plane], group, torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("group", [32, 128])
def test_the_kernel_matches_its_torch_twin(group: int) -> None:
    plane = _plane(96, 384, group)
    tiles, sz = amx_int4.pack(plane.codes, plane.scale, plane.zero)
    x = _x(37, 384)
    got = amx_int4.amx_int4_mm(x, tiles, sz, group).float()
    want = amx_int4.amx_int4_mm_reference(x, tiles, sz, group).float()
    ulp = want.abs().clamp_min(1e-3) * 2.0 ** -7  # one bf16 step: the fp32 sums' order may flip a rounding
    assert bool(((got - want).abs() <= ulp).all())


@needs_kernel
def test_a_row_is_the_same_bits_in_any_batch_and_at_any_thread_count() -> None:
    plane = _plane(80, 576, 32)
    tiles, sz = amx_int4.pack(plane.codes, plane.scale, plane.zero)
    x = _x(49, 576)
    full = amx_int4.amx_int4_mm(x, tiles, sz, 32)
    rows = [slice(0, m) for m in (1, 2, 15, 16, 17, 31, 33, 48)] + [slice(20, 21)]
    assert_rows_and_threads_invariant(lambda xs: amx_int4.amx_int4_mm(xs, tiles, sz, 32), x, full, rows)


@needs_kernel
def test_bad_arguments_are_refused() -> None:
    plane = _plane(32, 64, 32)
    tiles, sz = amx_int4.pack(plane.codes, plane.scale, plane.zero)
    with pytest.raises(ValueError, match="does not fit"):
        amx_int4.amx_int4_mm(_x(2, 64).float(), tiles, sz, 32)
    with pytest.raises(ValueError, match="does not fit"):
        amx_int4.amx_int4_mm(_x(2, 96), tiles, sz, 32)
    assert amx_int4.amx_int4_mm(_x(0, 64), tiles, sz, 32).shape == (0, 32)


@needs_kernel
def test_a_packed_linear_takes_the_kernel_and_keeps_its_weights() -> None:
    plane = _plane(64, 128, 32)
    bias = torch.randn(64)
    layer = PackedLinear([plane], bias, 32, CPU, torch.bfloat16, "int4")
    assert layer.amx and "kernel=amx" in repr(layer)
    assert torch.equal(layer.dequantize(), kernel_view([plane], 32, torch.bfloat16))
    x = _x(6, 128).float()
    want = (amx_int4.amx_int4_mm(x.bfloat16(), layer.packed0, layer.scales_and_zeros0, 32) + bias.bfloat16())
    assert torch.equal(layer(x), want.float())
    other = PackedLinear([_plane(32, 128, 32, seed=5)], None, 32, CPU, torch.bfloat16, "int4")
    nobias = PackedLinear([plane], None, 32, CPU, torch.bfloat16, "int4")
    fused = PackedLinear.concat([nobias, other])
    assert fused.amx
    assert torch.equal(fused(x), torch.cat([nobias(x), other(x)], dim=1))


def test_turned_off_a_packed_linear_keeps_torchs_kernel(torch_kernel: None) -> None:
    plane = _plane(64, 128, 32)
    layer = PackedLinear([plane], None, 32, CPU, torch.bfloat16, "int4")
    assert not layer.amx and "kernel=torch" in repr(layer)
    assert layer.packed0.shape == (64, 64)  # torch's CPU layout: [N, K / 2]
    assert torch.equal(layer.dequantize(), kernel_view([plane], 32, torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize(("n", "k", "group"), [(48, 512, 32), (64, 256, 64), (32, 4096, 32)])
def test_the_prompt_row_kernel_computes_the_dequantized_weight_and_a_rows_bits_alone(
        n: int, k: int, group: int) -> None:
    """``amx_int4_prompt_mm``: unit vectors give the layer's dequantized weight exactly (the dense
    copy's values); a row's bits do not depend on the other rows, the row count (1, below and above
    one or two 16-row tiles) or the thread count; K = 4096 takes the copy with rows off 4 KiB."""
    plane = _plane(n, k, group, seed=n + k)
    tiles, sz = amx_int4.pack(plane.codes, plane.scale, plane.zero)
    eye = torch.eye(k, dtype=torch.bfloat16)[:512]
    want = amx_int4.amx_int4_mm(eye, tiles, sz, group)  # the packed kernel's unit products: the weight
    assert torch.equal(amx_int4.amx_int4_prompt_mm(eye, tiles, sz, group), want)
    x = (torch.randn(70, k, generator=torch.Generator().manual_seed(3)) * 0.5).bfloat16()
    y = amx_int4.amx_int4_prompt_mm(x, tiles, sz, group)
    weight = kernel_view([plane], group, torch.bfloat16).float()  # [N, K]
    torch.testing.assert_close(y.float(), x.float() @ weight.t(), rtol=0.02, atol=0.02 * float(y.abs().max()))
    assert_rows_and_threads_invariant(lambda xs: amx_int4.amx_int4_prompt_mm(xs, tiles, sz, group), x, y,
                                      PROMPT_ROWS)
