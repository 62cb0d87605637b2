"""Group-16 scales held split (``proxy.quant.split_scales``): the split is exact or refused, and the
kernel's split entry gives the fp32-scale kernel's bits."""

from __future__ import annotations

import pytest
import torch

from proxy.engine.execution.plan import _linear_kernel
from proxy.quant import amx_int8, int8_linear
from proxy.quant.int8_linear import Int8Linear, kernel_available, q8_matmul
from proxy.quant.split_scales import q8_matmul_split, split_scales

needs_kernel = pytest.mark.skipif(
    not kernel_available(), reason="the int8 kernel needs x86-64 with AVX2 and FMA"
)


def _q6_k(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, scales, d, sc)`` as a ``Q6_K`` tensor holds them: 6-bit codes, an fp16 ``d`` per 256
    weights and an int8 ``sc`` per 16, ``scales = d * sc`` (exact in fp32)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g)
    d = (torch.rand(n, k // 256, generator=g) * 1e-3 + 1e-6).half().float()
    sc = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8, generator=g)
    return codes, d.repeat_interleave(16, dim=1) * sc.float(), d, sc


def test_q6_k_scales_split_exactly() -> None:
    _, scales, d, sc = _q6_k(37, 512)
    sc[3, :16] = 0  # a block of zero scales
    sc[4, 16:32] = 64 * torch.tensor([1, -2] * 8, dtype=torch.int8)  # a common factor of 64
    scales = d.repeat_interleave(16, dim=1) * sc.float()
    split = split_scales(scales)
    assert split is not None
    sub, block = split
    assert sub.dtype == torch.int8 and sub.shape == (37, 32) and block.dtype == torch.float32
    assert block.shape == (37, 2)
    rebuilt = block.repeat_interleave(16, dim=1) * sub.float()
    assert torch.equal(rebuilt.view(torch.int32), scales.view(torch.int32))
    assert torch.equal(sub[3, :16], torch.zeros(16, dtype=torch.int8)) and block[3, 0].item() == 0.0
    assert torch.equal(sub[4, 16:32].abs().unique(), torch.tensor([1, 2], dtype=torch.int8))
    assert block[4, 1].item() == d[4, 1].item() * 64


def test_llama_cpp_q6_k_scales_split_with_a_negative_block_scale() -> None:
    """llama.cpp's ``quantize_row_q6_K_ref``: ``iscale = -128 / max_scale``, ``d = 1 / iscale`` and
    ``sc = min(127, round(iscale * scale))``, so a block's largest scale is ``d * -128`` with ``d``
    negative (its sub-scale over the block's common factor would be 128)."""
    g = torch.Generator().manual_seed(3)
    wanted = torch.rand(6, 32, generator=g) * 2e-3 - 1e-3  # the sub-blocks' float scales, 2 blocks a row
    wanted[0, 5] = 2e-3  # a block whose largest scale is positive: d < 0
    wanted[1, 20] = -2e-3  # one whose largest is negative: d > 0
    blocks = wanted.view(6, 2, 16)
    max_scale = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    d = (max_scale / -128).half().float()
    sc = torch.clamp(torch.round(blocks * (-128 / max_scale)), max=127).to(torch.int8)
    assert bool((sc == -128).any(-1).all())  # every block holds a -128
    scales = (d * sc.float()).view(6, 32)
    split = split_scales(scales)
    assert split is not None
    sub, block = split
    assert bool((block[0, 0] < 0) & (block[1, 1] > 0))
    rebuilt = block.repeat_interleave(16, dim=1) * sub.float()
    assert torch.equal(rebuilt.view(torch.int32), scales.view(torch.int32))


def test_scales_that_do_not_split_are_refused() -> None:
    _, scales, _, _ = _q6_k(8, 256)
    odd = scales.clone()
    odd[2, 5] = 0.1  # 24 significant bits: no int8 multiple of the block's common factor
    assert split_scales(odd) is None
    assert split_scales(scales[:, :8]) is None  # not whole blocks of 256 inputs
    assert split_scales(scales.double()) is None
    inf = scales.clone()
    inf[0, 0] = float("inf")
    assert split_scales(inf) is None
    far = scales.clone()
    far[1, 0], far[1, 1] = 2.0 ** 40, 2.0 ** -40  # a block spanning more bits than int64 holds
    assert split_scales(far) is None


@needs_kernel
def test_the_split_entry_gives_the_fp32_scales_bits(isa: str) -> None:
    codes, scales, _, _ = _q6_k(200, 768)
    split = split_scales(scales)
    assert split is not None
    isa_value = int8_linear._isa()
    x = torch.randn(19, 768, generator=torch.Generator().manual_seed(1))
    whole = q8_matmul(x, codes, scales)
    assert torch.equal(q8_matmul_split(x, codes, *split, isa_value), whole)
    for rows in (slice(0, 1), slice(7, 8), slice(3, 19), slice(0, 16)):
        assert torch.equal(q8_matmul_split(x[rows], codes, *split, isa_value), whole[rows])
    unit = q8_matmul_split(torch.eye(768), codes, *split, isa_value).t()
    assert torch.equal(unit, (codes.float().view(200, -1, 16) * scales[..., None]).view(200, 768))


@needs_kernel
def test_an_int8_linear_of_group_16_takes_the_split_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    codes, scales, _, _ = _q6_k(64, 512)
    bias = torch.randn(64)
    with amx_int8.enabled(False):  # bf16 calls would take the AMX int8 kernel (tests/quant/test_amx_int8.py)
        layer = Int8Linear(codes, scales, bias, "Q6_K as int8 g16")
    assert layer.sub_scales is not None and layer.block_scales is not None
    calls: list[int] = []
    real = int8_linear.q8_matmul_split

    def spy(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(int8_linear, "q8_matmul_split", spy)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = layer(x)
    assert calls == [5]
    assert torch.equal(y, (q8_matmul(x.float(), codes, scales) + bias).bfloat16())
    fused = Int8Linear.concat([layer, layer])
    assert fused.sub_scales is not None and torch.equal(fused(x)[:, 64:], y)
    with amx_int8.enabled(False):
        assert Int8Linear(codes[:, :256], scales[:, :16], None).sub_scales is not None
        group_32 = Int8Linear(codes, scales[:, ::2].contiguous(), None)
    assert group_32.sub_scales is None  # only groups of 16 are split
    # the execution plan names the split (GET /server_info, the log's execution line)
    assert _linear_kernel(layer) == f"int8 q8 {int8_linear.KERNEL_ISA} split scales"
    assert _linear_kernel(group_32) == f"int8 q8 {int8_linear.KERNEL_ISA}"


@needs_kernel
def test_the_split_op_is_registered_for_torch_compile() -> None:
    codes, scales, _, _ = _q6_k(16, 256)
    split = split_scales(scales)
    assert split is not None
    torch.library.opcheck(torch.ops.streamproxy.q8_matmul_split.default,
                          (torch.randn(3, 256), codes, *split, int8_linear._isa()),
                          test_utils=("test_schema", "test_faketensor"))
