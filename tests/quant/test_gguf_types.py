"""proxy.quant.gguf_types: Q4_K / Q5_0 / Q5_1 / Q5_K / IQ4_NL / IQ4_XS / Q6_K blocks decoded into layouts
whose weights equal gguf-py's dequantization bit for bit, on random blocks (gguf-py quantizes only Q5_0 and
Q5_1 of these: the others are random bytes with valid fp16 scales), and the reasons the other types are
re-quantized."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from proxy.quant.gguf_blocks import decode_blocks
from proxy.quant.gguf_types import exact_layout, int8_codes, q4_k_planes, requantize_reason
from proxy.quant.linear import PackedLinear

T = gguf.GGMLQuantizationType
CPU = torch.device("cpu")

#: byte offsets of each type's fp16 fields in a block, and the range their values are drawn from
FP16_FIELDS = {
    T.Q4_K: ((0, 2), (2, 4)),  # d, dmin
    T.Q5_K: ((0, 2), (2, 4)),
    T.Q6_K: ((208, 210),),  # d, after ql, qh and the 16 int8 scales
    T.IQ4_NL: ((0, 2),),
    T.IQ4_XS: ((0, 2),),
    T.Q5_1: ((0, 2), (2, 4)),
    T.Q2_K: ((80, 82), (82, 84)),  # after 16 scale bytes and 64 bytes of 2-bit codes
}


def random_blocks(
    qtype: T, n: int, k: int, seed: int, dmin_ratio: tuple[float, float] = (2.0, 12.0)
) -> np.ndarray:
    """uint8 ``[n, k / block * block_bytes]``: random codes and sub-block scales, valid fp16 scales
    (``d`` in [1e-4, 4e-4], a second field such as ``dmin`` ``d`` times ``dmin_ratio``)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    d = rng.uniform(1e-4, 4e-4, size=(n, k // block)).astype(np.float16)
    fields = FP16_FIELDS[qtype]
    raw[..., fields[0][0]:fields[0][1]] = d[..., None].view(np.uint8)
    if len(fields) > 1:
        second = d.astype(np.float32) * rng.uniform(*dmin_ratio, size=d.shape)
        raw[..., fields[1][0]:fields[1][1]] = second.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def _gguf_values(raw: np.ndarray, qtype: T, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw, qtype).reshape(shape))


def test_q4_k_plane_equals_gguf_dequantize_bit_for_bit() -> None:
    shape = (48, 512)
    raw = random_blocks(T.Q4_K, *shape, seed=1)
    planes, inexact = q4_k_planes(raw, shape)
    assert inexact == 0 and len(planes) == 1
    plane = planes[0]
    assert plane.codes.dtype == torch.uint8 and int(plane.codes.max()) <= 15
    assert plane.scale.shape == (48, 16) and plane.zero.shape == (48, 16)
    want = _gguf_values(raw, T.Q4_K, shape)
    assert torch.equal(plane.dequantize(32), want)
    assert torch.equal(plane.dequantize_exact_products(32), want)
    layer = PackedLinear(planes, None, 32, CPU, torch.float32, "Q4_K")  # the fp32 kernel's weights
    assert torch.equal(layer.dequantize(), want)


def test_q4_k_zero_rounded_only_when_dmin_is_far_from_d() -> None:
    """``zero = 8 d sc - dmin m`` needs more than fp32's 24 bits when dmin and d are far apart: those
    groups are counted, and their weights stay within half an ulp of the zero of gguf's."""
    shape = (16, 256)
    raw = random_blocks(T.Q4_K, *shape, seed=2, dmin_ratio=(3000.0, 6000.0))
    planes, inexact = q4_k_planes(raw, shape)
    assert 0 < inexact <= 16 * 8
    got, want = planes[0].dequantize(32), _gguf_values(raw, T.Q4_K, shape)
    assert not torch.equal(got, want)
    half_ulp = torch.finfo(torch.float32).eps * planes[0].zero.abs().repeat_interleave(32, 1)
    assert bool(((got - want).abs() <= half_ulp).all())


@pytest.mark.parametrize("qtype", [T.Q5_0, T.IQ4_NL, T.IQ4_XS, T.Q8_0, T.Q6_K, T.Q5_1, T.Q5_K, T.Q4_K])
def test_int8_codes_equal_gguf_dequantize_bit_for_bit(qtype: T) -> None:
    shape = (48, 512)
    group = 16 if qtype == T.Q6_K else 32
    if qtype in (T.Q5_0, T.Q8_0, T.Q5_1):  # gguf-py quantizes these
        w = np.random.default_rng(3).standard_normal(shape).astype(np.float32) * 0.05
        raw = quantize(w, qtype)
    else:
        raw = random_blocks(qtype, *shape, seed=3)
    codes, scales, zeros = int8_codes(qtype.name, raw, shape)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (48, 512 // group)
    assert (zeros is not None) == (qtype in (T.Q5_1, T.Q5_K, T.Q4_K))
    want = _gguf_values(raw, qtype, shape)
    got = codes.view(48, -1, group).float() * scales[..., None]
    if zeros is not None:
        assert zeros.shape == scales.shape and zeros.dtype == torch.float32
        got += zeros[..., None]
    assert torch.equal(got.view(shape), want)
    if qtype in (T.Q6_K, T.Q5_1, T.Q5_K, T.Q4_K):  # int8 kernel only (tests/quant/test_int8_linear.py)
        if qtype != T.Q4_K:  # Q4_K's linears are int4 planes (above)
            with pytest.raises(ValueError, match="not decoded losslessly"):
                decode_blocks(qtype.name, raw, shape)
        return
    planes = decode_blocks(qtype.name, raw, shape)  # the two-plane layout where the int8 kernel does not run
    layer = PackedLinear(planes, None, 32, CPU, torch.float32, qtype.name)
    assert torch.equal(layer.dequantize(), want)


def test_iq4_xs_uses_every_sub_block_scale() -> None:
    """The 6-bit sub-block scales (4 low bits in scales_l, 2 high in scales_h) reach each 32-weight
    group: a tensor whose scales all differ decodes to 8 distinct scales per super-block."""
    raw = random_blocks(T.IQ4_XS, 4, 256, seed=4).reshape(4, 136)
    raw[:, 2:4] = np.array([0b1110010011100100], np.uint16).view(np.uint8)  # high bits 0,1,2,3,0,1,2,3
    raw[:, 4:8] = np.array([0x10, 0x32, 0x54, 0x76], np.uint8)  # low bits 0..7
    _, scales, _ = int8_codes("IQ4_XS", raw, (4, 256))
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)
    ls = np.array([0, 1, 2, 3, 4, 5, 6, 7]) | (np.array([0, 1, 2, 3, 0, 1, 2, 3]) << 4)
    assert torch.equal(scales, torch.from_numpy(d * (ls - 32).astype(np.float32)))


def test_layouts_and_reasons() -> None:
    assert exact_layout("Q4_K", 512) == "int4" and exact_layout("Q4_K", 96) is None
    assert exact_layout("IQ4_XS", 256) == "int8" and exact_layout("Q5_0", 96) == "int8"
    assert exact_layout("Q6_K", 256) == "int8" and exact_layout("Q6_K", 128) is None
    assert exact_layout("Q5_K", 256) == "int8" and exact_layout("Q5_1", 64) == "int8"
    assert exact_layout("Q2_K", 256) is None and exact_layout("F16", 256) is None
    assert "groups of 16" in requantize_reason("Q6_K")
    assert "zero term" in requantize_reason("Q5_K") and "zero term" in requantize_reason("Q5_1")
    assert requantize_reason("IQ2_XS") == "no packed layout holds IQ2_XS blocks here"
    with pytest.raises(ValueError, match="Q2_K blocks have no int8 layout"):
        int8_codes("Q2_K", np.zeros((1, 84), np.uint8), (1, 256))
