"""``streamproxy::paged_decode_attention``: decode rows attending over the paged pools directly
(``ext/kernels/torch_ops.cpp``; the compiled decode step's attention where the C++ kernels load)."""

from __future__ import annotations

import threading

import pytest
import torch

from proxy.engine.execution.attention import kernels
from proxy.quant import kernels as op_kernels

needs_cpp = pytest.mark.skipif(not op_kernels.cpp_kernels_loaded(),
                               reason=f"the C++ op kernels are not loaded ({op_kernels.TORCH_OPS_ERROR})")

OP = kernels.paged_decode_attention


def _case(rows: int, heads: int, heads_kv: int, dk: int, dv: int, ctx: list[int], dtype: torch.dtype,
          slots_total: int = 512, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """query [B, H, Dk] (a strided view, as the model passes it), pools, slots [B, L] (each row's
    context on distinct random slots, the padding on slot 0) and context_lens [B]."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(1, heads, rows, dk, generator=g).to(dtype)[0].transpose(0, 1)
    key_pool = torch.randn(slots_total, heads_kv, dk, generator=g).to(dtype)
    value_pool = torch.randn(slots_total, heads_kv, dv, generator=g).to(dtype)
    keys = -(-max(ctx) // 64) * 64
    slots = torch.zeros(rows, keys, dtype=torch.long)
    for b, n in enumerate(ctx):
        slots[b, :n] = torch.randperm(slots_total, generator=g)[:n]
    return query, key_pool, value_pool, slots, torch.tensor(ctx, dtype=torch.long)


def _exact(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, slots: torch.Tensor,
           ctx: torch.Tensor, scale: float) -> torch.Tensor:
    """The attention in float64, per row over its own keys ``[B, H, Dv]``."""
    rows, heads, _ = query.shape
    group = heads // key_pool.shape[1]
    out = []
    for b in range(rows):
        own = slots[b, : int(ctx[b])]
        k = key_pool[own].double().repeat_interleave(group, dim=1)  # [n, H, Dk]
        v = value_pool[own].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[b].double(), k) * scale
        out.append(torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v))
    return torch.stack(out)


CASES = [  # rows, H, H_kv, Dk, Dv, contexts, dtype
    (1, 9, 3, 64, 64, [160], torch.bfloat16),  # SmolLM2-135M, one stream
    (5, 9, 3, 64, 64, [1, 17, 64, 65, 300], torch.bfloat16),
    (3, 8, 2, 128, 128, [33, 7, 129], torch.bfloat16),
    (2, 4, 4, 48, 32, [20, 81], torch.bfloat16),  # widths not a multiple of 16: the generic loops
    (3, 6, 2, 64, 64, [5, 70, 16], torch.float32),
    (2, 6, 1, 64, 64, [9, 40], torch.float16),
]


@needs_cpp
@pytest.mark.parametrize(("rows", "heads", "heads_kv", "dk", "dv", "ctx", "dtype"), CASES)
def test_the_op_is_the_attention_over_each_rows_own_keys(
    rows: int, heads: int, heads_kv: int, dk: int, dv: int, ctx: list[int], dtype: torch.dtype
) -> None:
    args = _case(rows, heads, heads_kv, dk, dv, ctx, dtype)
    scale = dk ** -0.5
    got = OP(*args, scale)
    assert got.shape == (rows, heads, dv) and got.dtype == dtype
    want = _exact(*args, scale)
    # one rounding to the dtype (half a unit in the last place) after fp32 math, whose error is
    # bounded by a few fp32 epsilons of the largest value summed
    ulp = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -23}[dtype]  # epsilon
    fp32_error = 64 * 2.0 ** -23 * float(args[2].abs().max())
    excess = (got.double() - want).abs() - 0.5 * ulp * want.abs() - fp32_error
    assert float(excess.max()) <= 0, float(excess.max())
    # the Python kernel (the op's kernel where the C++ library is not loaded) is the same math
    ref = kernels._paged_decode_attention_reference(*args, scale)
    excess = (ref.double() - got.double()).abs() - ulp * want.abs() - 2 * fp32_error
    assert float(excess.max()) <= 0, float(excess.max())


@needs_cpp
def test_a_rows_output_is_the_same_bits_alone_in_a_batch_and_with_any_padding() -> None:
    query, key_pool, value_pool, slots, ctx = _case(6, 9, 3, 64, 64, [3, 160, 64, 200, 1, 90], torch.bfloat16)
    batch = OP(query, key_pool, value_pool, slots, ctx, 0.125)
    for b in range(6):
        n = int(ctx[b])
        alone = OP(query[b:b + 1], key_pool, value_pool, slots[b:b + 1, :n], ctx[b:b + 1], 0.125)
        assert torch.equal(alone, batch[b:b + 1]), b
        padded = torch.full((1, 512), 7, dtype=torch.long)  # the padding is never read
        padded[0, :n] = slots[b, :n]
        longer = OP(query[b:b + 1], key_pool, value_pool, padded, ctx[b:b + 1], 0.125)
        assert torch.equal(longer, batch[b:b + 1]), b


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_key_gives_its_value_and_a_dominant_key_takes_the_softmax(dtype: torch.dtype) -> None:
    query, key_pool, value_pool, slots, _ = _case(1, 9, 3, 64, 64, [40], dtype)
    one = OP(query, key_pool, value_pool, slots, torch.tensor([1]), 0.125)
    assert torch.equal(one[0], value_pool[slots[0, 0]].repeat_interleave(3, dim=0))
    # a key equal to 50x the query makes every other weight underflow: exactly that key's value
    key_pool[slots[0, 7]] = (query[0].float().view(3, 3, 64)[:, 0] * 50).to(dtype)
    query = query.contiguous().view(1, 3, 3, 64)[:, :, :1].expand(1, 3, 3, 64).reshape(1, 9, 64)
    top = OP(query, key_pool, value_pool, slots, torch.tensor([40]), 1.0)
    assert torch.equal(top[0], value_pool[slots[0, 7]].repeat_interleave(3, dim=0))


@needs_cpp
def test_bad_arguments_are_refused_by_name() -> None:
    query, key_pool, value_pool, slots, ctx = _case(2, 9, 3, 64, 64, [10, 20], torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"context_lens\[1\] = 65 is not in \[1, 64\]"):
        OP(query, key_pool, value_pool, slots, torch.tensor([10, 65]), 0.125)
    with pytest.raises(RuntimeError, match=r"context_lens\[0\] = 0"):
        OP(query, key_pool, value_pool, slots, torch.tensor([0, 20]), 0.125)
    bad = slots.clone()
    bad[1, 19] = 512
    with pytest.raises(RuntimeError, match="slot 512 .row 1, key 19. is outside the pools' 512 slots"):
        OP(query, key_pool, value_pool, bad, ctx, 0.125)
    with pytest.raises(RuntimeError, match="one dtype"):
        OP(query.float(), key_pool, value_pool, slots, ctx, 0.125)
    with pytest.raises(RuntimeError, match="shapes do not fit"):
        OP(query[:, :8], key_pool, value_pool, slots, ctx, 0.125)
    with pytest.raises(RuntimeError, match="int64 slots"):
        OP(query, key_pool, value_pool, slots.int(), ctx, 0.125)


@needs_cpp
def test_the_op_passes_opcheck() -> None:
    args = _case(2, 9, 3, 64, 64, [10, 20], torch.bfloat16)
    torch.library.opcheck(OP, (*args, 0.125), test_utils=("test_schema", "test_faketensor"))


@needs_cpp
def test_the_op_keeps_the_calling_threads_openmp_count() -> None:
    """The engine thread keeps its count after another thread's ``torch.set_num_threads(1)`` (the
    embedding worker's): an op whose first parallel call initialised the thread from the
    process-wide value made the server decode on one thread."""
    args = _case(2, 9, 3, 64, 64, [100, 200], torch.bfloat16)
    before = torch.get_num_threads()
    seen: list[int] = []

    def engine() -> None:
        torch.set_num_threads(2)
        seen.append(torch.get_num_threads())
        other = threading.Thread(target=torch.set_num_threads, args=(1,))
        other.start()
        other.join()
        OP(*args, 0.125)
        seen.append(torch.get_num_threads())

    try:
        thread = threading.Thread(target=engine)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(before)
    assert seen == [2, 2]
