"""The int4 kernel's AVX2 variant (``ext/kernels/avx2_int4.h``): the AMX kernel's weights summed in the
order its header gives, on any CPU with AVX2 and FMA (so these run on AMX machines too)."""

from __future__ import annotations

import pytest
import torch

from proxy.quant import amx_int4, kernels

pytestmark = pytest.mark.skipif(
    amx_int4.KERNEL_IMPORT_ERROR is not None or not {"avx2", "fma"} <= kernels.cpu_flags(),
    reason="the AVX2 int4 kernel needs the extension and a CPU with AVX2 and FMA",
)


def _weights(n: int, k: int, group: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.randn(n, k // group, generator=g) * 0.05
    zero = torch.randn(n, k // group, generator=g) * 0.05
    tiles, sz = amx_int4.pack(codes, scale, zero)
    return codes, tiles, sz


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 ``fma(a, b, c)``: the product of an fp32 and a bf16 value is exact in fp64, and so is its
    sum with an fp32 value within 29 binades of it (every sum here: values of like size), so rounding
    that sum once to fp32 is the fused result."""
    return (a.double() * b.double() + c.double()).float()


def _header_order(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    """The header's sums, step by step in torch: each product ``x * 2^-b * (code * 2^b)`` is exact in
    fp32 (for these inputs), so an fp32 add of it is the kernel's fused multiply-add."""
    m, k = x.shape
    n = codes.shape[0]
    g_count = k // group
    xf = x.float()
    # input 8q + o of a tile sits in the nibble at bit b = 4 (o // 2) + 16 (o % 2) (bit 28: shifted down)
    bits = torch.tensor([4 * (o // 2) + 16 * (o % 2) for o in range(8)]).repeat(k // 8)
    bits = torch.where(bits == 28, 0, bits)
    xs = xf * torch.pow(2.0, -bits.float())
    shifted = codes.float() * torch.pow(2.0, bits.float())  # code * 2^b, exact
    prod = (xs[:, None, :] * shifted[None]).reshape(m, n, g_count, group)
    p = prod[..., 0]
    for j in range(1, group):
        p = p + prod[..., j]  # [M, N, G]: the sum of x * code
    lanes = xf.reshape(m, g_count, group // 8, 8)
    acc_l = lanes[:, :, 0]
    for j in range(1, group // 8):
        acc_l = acc_l + lanes[:, :, j]
    four = acc_l[..., :4] + acc_l[..., 4:]
    sums = (four[..., 0] + four[..., 2]) + (four[..., 1] + four[..., 3])  # [M, G]
    s = sz[0].float().permute(0, 2, 1).reshape(n, g_count)
    z = sz[1].float().permute(0, 2, 1).reshape(n, g_count)
    acc = torch.zeros(m, n)
    for g in range(g_count):
        centred = _fma32(sums[:, g, None], torch.tensor(-8.0), p[:, :, g])  # the sum of x * (code - 8)
        acc = _fma32(centred, s[None, :, g], acc)
        acc = _fma32(sums[:, g, None], z[None, :, g], acc)
    return acc.to(torch.bfloat16)


@pytest.mark.parametrize(("n", "k", "group", "m"), [(48, 64, 32, 1), (48, 128, 32, 2), (16, 256, 64, 3),
                                                      (32, 256, 256, 6), (64, 96, 32, 9)])
def test_the_kernel_sums_in_the_headers_order(n: int, k: int, group: int, m: int) -> None:
    codes, tiles, sz = _weights(n, k, group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = amx_int4.avx2_int4_mm(x, tiles, sz, group)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert torch.equal(got, _header_order(x, codes, sz, group))


def test_a_rows_bits_do_not_depend_on_the_batch_or_the_threads() -> None:
    """One row takes two blocks at once, 2 rows both halves of a block, more rows 8 rows a half at a
    time (11 rows: a tile of 8 and one of 3)."""
    _, tiles, sz = _weights(64, 512, 32, seed=3)
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(4)).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = amx_int4.avx2_int4_mm(x, tiles, sz, 32)
        torch.set_num_threads(max(2, threads))
        whole = amx_int4.avx2_int4_mm(x, tiles, sz, 32)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, whole)
    for lo, hi in ((0, 1), (3, 5), (2, 9), (5, 11), (7, 10), (1, 4)):
        assert torch.equal(amx_int4.avx2_int4_mm(x[lo:hi], tiles, sz, 32), whole[lo:hi]), (lo, hi)


def test_a_unit_vector_gives_the_dense_copys_weight() -> None:
    codes, tiles, sz = _weights(32, 128, 64, seed=5)
    w = amx_int4.avx2_int4_mm(torch.eye(128, dtype=torch.bfloat16), tiles, sz, 64).t()
    s = sz[0].float().permute(0, 2, 1).reshape(32, 2).repeat_interleave(64, 1)
    z = sz[1].float().permute(0, 2, 1).reshape(32, 2).repeat_interleave(64, 1)
    dense = _fma32(torch.ones(()), z, _fma32(codes.float() - 8, s, torch.zeros(()))).to(torch.bfloat16)
    assert torch.equal(w, dense)


def test_layers_take_the_avx2_variant_where_there_is_no_amx() -> None:
    """On an AVX2 machine the served int4 layers and the compiled step's op run this variant."""
    if amx_int4.kernel_isa() != "avx2":
        pytest.skip(f"this CPU runs the {amx_int4.kernel_isa()} variant")
    _, tiles, sz = _weights(32, 128, 32, seed=6)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(7)).bfloat16()
    assert torch.equal(amx_int4.amx_int4_mm(x, tiles, sz, 32), amx_int4.avx2_int4_mm(x, tiles, sz, 32))


def test_a_long_call_runs_in_chunks_of_rows_with_the_same_bits() -> None:
    """More than 256 rows run 256 at a time (x's fp32 copy stays small): rows are independent."""
    codes, tiles, sz = _weights(32, 64, 32, seed=8)
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(9)).bfloat16()
    whole = amx_int4.avx2_int4_mm(x, tiles, sz, 32)
    assert torch.equal(whole, _header_order(x, codes, sz, 32))
    for lo, hi in ((0, 1), (255, 257), (299, 300)):
        assert torch.equal(amx_int4.avx2_int4_mm(x[lo:hi], tiles, sz, 32), whole[lo:hi]), (lo, hi)


def test_the_prompt_row_kernel_is_refused_on_the_avx2_variant() -> None:
    if amx_int4.kernel_isa() != "avx2":
        pytest.skip(f"this CPU runs the {amx_int4.kernel_isa()} variant")
    _, tiles, sz = _weights(32, 64, 32)
    with pytest.raises(RuntimeError, match="needs the AMX variant"):
        amx_int4.amx_int4_prompt_mm(torch.zeros(2, 64, dtype=torch.bfloat16), tiles, sz, 32)
