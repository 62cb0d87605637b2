"""The C++ kernels of this project's torch ops (``ext/kernels/torch_ops.cpp``, loaded by
``proxy.quant.kernels``): the ops a compiled decode step calls, without the GIL."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

from proxy.quant import amx_int4, amx_int8, int8_linear, kernels
from proxy.quant.linear import quantize_int4

needs_cpp = pytest.mark.skipif(not kernels.cpp_kernels_loaded(),
                               reason=f"the C++ op kernels are not loaded ({kernels.TORCH_OPS_ERROR})")
needs_int4 = pytest.mark.skipif(not amx_int4.kernel_available(),
                                reason="the int4 kernel needs AMX-BF16 or AVX2 and FMA")
needs_q8 = pytest.mark.skipif(not int8_linear.kernel_available(), reason="the Q8_0 kernel needs AVX2 and FMA")


def _cpu_kernel_source(op: str) -> str:
    """Where the dispatcher's CPU kernel of ``streamproxy::<op>`` was registered."""
    for line in torch._C._dispatch_dump(f"streamproxy::{op}").splitlines():
        if line.startswith("CPU:"):
            return line
    raise AssertionError(f"streamproxy::{op} has no CPU kernel")


def test_the_cpp_kernels_are_built_and_serve_the_ops_where_ci_requires_it() -> None:
    if os.environ.get("STREAMPROXY_REQUIRE_COMPILED") != "1":
        pytest.skip("STREAMPROXY_REQUIRE_COMPILED is not set")
    assert kernels.TORCH_OPS_ERROR is None
    for op in ("amx_int4_mm", "amx_int8_mm", "q8_matmul", "paged_decode_attention"):
        assert "torch_ops.cpp" in _cpu_kernel_source(op), op


def _amx_weights(n: int, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    (plane,) = quantize_int4(torch.randn(n, k, generator=torch.Generator().manual_seed(0)), group)
    return amx_int4.pack(plane.codes, plane.scale, plane.zero)


@needs_cpp
@needs_int4
@pytest.mark.parametrize("group", [32, 64])
def test_the_int4_op_gives_the_extension_calls_bits(group: int) -> None:
    """On this CPU's variant (AMX or AVX2: ``sp_int4_matmul``), in C++ and through the extension."""
    tiles, sz = _amx_weights(48, 192, group)
    x = torch.randn(49, 192, generator=torch.Generator().manual_seed(1)).bfloat16()
    op = torch.ops.streamproxy.amx_int4_mm.default
    for m in (0, 1, 2, 15, 16, 17, 33, 49):  # 17, 33 and 49 rows: the C++ kernel pads to 16-row tiles
        got = op(x[:m], tiles, sz, group)
        assert got.shape == (m, 48) and got.dtype == torch.bfloat16
        assert torch.equal(got, amx_int4._run(x[:m].contiguous(), tiles, sz, group)), m
    strided = x[:8, :].t().contiguous().t()  # a non-contiguous view of the same values
    assert torch.equal(op(strided, tiles, sz, group), op(x[:8], tiles, sz, group))
    torch.library.opcheck(op, (x[:3], tiles, sz, group), test_utils=("test_schema", "test_faketensor"))


@needs_cpp
@needs_int4
def test_the_int4_op_refuses_arguments_that_do_not_fit() -> None:
    tiles, sz = _amx_weights(32, 64, 32)
    op = torch.ops.streamproxy.amx_int4_mm.default
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="takes bf16 x"):
        op(x.float(), tiles, sz, 32)
    with pytest.raises(RuntimeError, match="shapes do not fit"):
        op(torch.randn(2, 96).bfloat16(), tiles, sz, 32)
    with pytest.raises(RuntimeError, match="shapes do not fit"):
        op(x, tiles, sz, 48)
    with pytest.raises(RuntimeError, match="contiguous weights"):
        op(x, tiles.transpose(0, 1), sz, 32)


@needs_cpp
@pytest.mark.skipif(not amx_int8.kernel_available(), reason="the AMX int8 kernel needs AMX-BF16")
@pytest.mark.parametrize("group", [32, 16])
def test_the_amx_int8_op_gives_the_extension_calls_bits(group: int) -> None:
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-32, 32, (48, 512), generator=g, dtype=torch.int8)
    scales = torch.randint(1, 64, (48, 512 // group), generator=g).float() * 2.0 ** -12
    packed, sub, six_bit = amx_int8.pack(codes, scales)
    assert (sub is not None) == (group == 16)
    x = torch.randn(49, 512, generator=g).bfloat16()
    op = torch.ops.streamproxy.amx_int8_mm.default
    for m in (0, 1, 2, 16, 17, 49):
        got = op(x[:m], codes, packed, sub, group, six_bit)
        assert got.shape == (m, 48) and got.dtype == torch.float32
        assert torch.equal(got, amx_int8._amx_int8_op(x[:m], codes, packed, sub, group, six_bit)), m
    strided = x[:8, :].t().contiguous().t()
    assert torch.equal(op(strided, codes, packed, sub, group, six_bit), op(x[:8], codes, packed, sub, group,
                                                                           six_bit))
    with pytest.raises(RuntimeError, match="shapes do not fit"):
        op(x[:, :256], codes, packed, sub, group, six_bit)
    with pytest.raises(RuntimeError, match="takes bf16 x"):
        op(x.float(), codes, packed, sub, group, six_bit)


@needs_cpp
@needs_q8
@pytest.mark.parametrize(("group", "with_zeros"), [(32, False), (16, False), (32, True)])
def test_the_q8_op_gives_the_extension_calls_bits(group: int, with_zeros: bool) -> None:
    g = torch.Generator().manual_seed(2)
    n, k = 40, 96
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=g)
    zeros = torch.randn(n, k // group, generator=g) if with_zeros else None
    x = torch.randn(17, k, generator=g)
    op = torch.ops.streamproxy.q8_matmul.default
    ext = int8_linear._q8_matmul
    assert ext is not None
    best = ext.ISAS[int8_linear.supported_isas()[-1]]
    for name in int8_linear.supported_isas():
        isa = ext.ISAS[name]
        for m in (0, 1, 5, 17):
            want = torch.empty(m, n)
            if m:
                ext.q8_matmul(x.data_ptr(), m, k, codes.data_ptr(), scales.data_ptr(),
                              0 if zeros is None else zeros.data_ptr(), group, n, want.data_ptr(),
                              torch.get_num_threads(), isa)
            assert torch.equal(op(x[:m], codes, scales, zeros, isa), want), (name, m)
    with pytest.raises(RuntimeError, match="instruction set 7"):
        op(x, codes, scales, zeros, 7)
    with pytest.raises(RuntimeError, match="shapes do not fit"):
        op(x[:, :64], codes, scales, zeros, best)
    with pytest.raises(RuntimeError, match="shapes do not fit"):  # groups of 8
        op(x, codes, torch.rand(n, k // 8), None, best)
    with pytest.raises(RuntimeError, match="zeros shaped as the scales"):
        op(x, codes, scales, torch.rand(n, 1), best)
    with pytest.raises(RuntimeError, match="takes fp32 x"):
        op(x.double(), codes, scales, zeros, best)


@needs_cpp
@needs_int4
def test_turned_off_the_ops_keep_their_python_kernels_with_the_same_bits() -> None:
    script = textwrap.dedent("""
        import torch
        from proxy.quant import amx_int4, kernels
        from proxy.quant.linear import quantize_int4
        (plane,) = quantize_int4(torch.randn(48, 192, generator=torch.Generator().manual_seed(0)), 32)
        tiles, sz = amx_int4.pack(plane.codes, plane.scale, plane.zero)
        x = torch.randn(17, 192, generator=torch.Generator().manual_seed(1)).bfloat16()
        dump = torch._C._dispatch_dump("streamproxy::amx_int4_mm").splitlines()
        cpu = [line for line in dump if line.startswith("CPU:")]
        print(kernels.TORCH_OPS_ERROR)
        print(cpu[0])
        torch.save(torch.ops.streamproxy.amx_int4_mm(x, tiles, sz, 32), "out.pt")
    """)
    env = {**os.environ, kernels.TORCH_OPS_ENV: "0"}
    with tempfile.TemporaryDirectory() as d:
        done = subprocess.run([sys.executable, "-c", script], check=False, cwd=d, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        reason, cpu = done.stdout.splitlines()[-2:]
        assert reason == f"turned off ({kernels.TORCH_OPS_ENV}=0)"
        assert "kernels.py" in cpu and "torch_ops.cpp" not in cpu
        python_out = torch.load(f"{d}/out.pt")
    tiles, sz = _amx_weights(48, 192, 32)
    x = torch.randn(17, 192, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert torch.equal(torch.ops.streamproxy.amx_int4_mm(x, tiles, sz, 32), python_out)
