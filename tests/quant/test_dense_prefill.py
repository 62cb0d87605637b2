"""Prompt tokens through dense copies of the packed weights (proxy.quant.dense_prefill): the row
plan, the bits of a row whatever else the step holds, and the engine's text whatever the chunking,
batching and prefix cache."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from engine.engine_helpers import run_staggered

from proxy.engine.block_manager import BlockManager
from proxy.engine.core import EngineCore
from proxy.engine.execution.choice import PrefillPlan
from proxy.engine.request import Request
from proxy.quant import amx_int4, kernel_dtype, kernels, quantize_linears
from proxy.quant.apply import add_dense_weights, use_prompt_tiles
from proxy.quant.dense_prefill import (
    CALL_ROWS,
    RowPlan,
    active_row_plan,
    current_row_plan,
    dense_prefill_default,
    dense_weight_dtype,
    has_dense_weights,
    plan_rows,
)
from proxy.quant.linear import PackedLinear, quantize_int4
from proxy.sampling import SamplingParams
from proxy.settings import Settings

BF16 = kernel_dtype(torch.device("cpu")) == torch.bfloat16
needs_bf16 = pytest.mark.skipif(not BF16, reason="dense copies are made for bf16 kernels only")


def _step(parts: list[tuple[int, int, bool]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat positions and dense flags of a step: ``(start, count, dense)`` per request, in order."""
    positions = torch.cat([torch.arange(s, s + n) for s, n, _ in parts])
    dense = torch.cat([torch.full((n,), d) for _, n, d in parts])
    return positions, dense


def test_plan_rows_puts_each_prompt_token_at_its_position_mod_call_rows() -> None:
    # two decodes (packed), A's prompt chunk at 60..69, B's at 0..9: rows 60-63 and 0-5 | 0-9 collide
    positions, dense = _step([(100, 1, False), (50, 1, False), (60, 10, True), (0, 10, True)])
    plan = plan_rows(positions, dense)
    assert plan is not None
    assert plan.num_tokens == 22 and plan.num_calls == 2 and plan.num_leading_packed == 2
    assert plan.dense_src.tolist() == list(range(2, 22))
    rows = [p % CALL_ROWS for p in positions[2:].tolist()]
    calls = [0] * 10 + [1] * 6 + [0] * 4  # B's 0-5 meet A's 64-69 (rows 0-5) earlier in the step
    assert plan.dense_dst.tolist() == [c * CALL_ROWS + r for c, r in zip(calls, rows, strict=True)]
    assert torch.equal(plan.gather[plan.dense_dst], plan.dense_src)
    assert not plan.in_place and plan.packed_src is not None and plan.packed_src.tolist() == [0, 1]
    assert plan_rows(*_step([(7, 1, False)])) is None  # decodes only: the packed kernel alone
    aligned = plan_rows(*_step([(64, 128, True)]))
    assert aligned is not None and aligned.in_place and aligned.num_calls == 2


def test_plan_rows_in_step_order_is_one_call_padded_to_call_rows() -> None:
    positions, dense = _step([(100, 1, False), (60, 10, True), (0, 70, True)])
    plan = plan_rows(positions, dense, by_position=False)
    assert plan is not None and plan.one_call and plan.num_calls == 2 and plan.num_leading_packed == 1
    assert plan.dense_dst.tolist() == list(range(80)) and plan.dense_src.tolist() == list(range(1, 81))
    assert plan.gather.tolist() == list(range(1, 81)) + [1] * 48  # padding repeats a dense row
    assert not plan.in_place
    aligned = plan_rows(*_step([(3, 64, True), (0, 64, True)]), by_position=False)
    assert aligned is not None and aligned.in_place and aligned.num_calls == 2  # positions do not matter


def _fp32_rows_are_invariant() -> bool:
    """Whether this CPU's fp32 GEMM gives a row the same bits at any place in calls of 64 or more
    rows, whatever the other rows hold (measured on AVX2 and AVX-512 CPUs' MKL sgemm)."""
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(96, 64, generator=gen), torch.randn(1, 64, generator=gen)
    ref = F.linear(torch.cat([x, torch.zeros(63, 64)]), w)[0]
    for rows, at in ((64, 37), (128, 100), (192, 5)):
        call = torch.randn(rows, 64, generator=gen)
        call[at] = x[0]
        if not torch.equal(F.linear(call, w)[at], ref):
            return False
    return True


def test_fp32_copies_take_fp32_activations_in_one_call() -> None:
    """fp32 copies (CPUs without BF16 instructions) read the activations unrounded, all dense rows
    in one call; a decode row keeps the packed kernel."""
    torch.manual_seed(0)
    layer = PackedLinear(quantize_int4(torch.randn(128, 64) * 0.1, 32), torch.randn(128) * 0.1, 32,
                         torch.device("cpu"), kernel_dtype(torch.device("cpu")), "int4 g32")
    layer.set_dense_weight(layer.dequantize().float())
    x = torch.randn(71, 64)
    plan = plan_rows(*_step([(9, 1, False), (0, 70, True)]), by_position=False)
    with active_row_plan(plan):
        y = layer(x)
    assert y.dtype == torch.float32 and torch.equal(y[0], layer(x[:1])[0])
    padded = torch.cat([x[1:], x[1:2].expand(58, 64)])  # the call: 70 rows + 58 repeats = 128
    want = F.linear(padded, layer.dense_weight)[:70] + layer.bias  # type: ignore[arg-type,operator]
    assert torch.equal(y[1:], want)
    assert not torch.equal(y[1:], F.linear(x[1:].bfloat16().float(), layer.dense_weight) + layer.bias)  # type: ignore[arg-type,operator]
    if _fp32_rows_are_invariant():
        alone = F.linear(torch.cat([x[5:6], torch.zeros(63, 64)]), layer.dense_weight)[0] + layer.bias  # type: ignore[arg-type,operator]
        assert torch.equal(y[5], alone)


def test_a_row_plan_holds_on_its_own_thread_only() -> None:
    """The plan a forward pass sets is seen by that thread's layers, not by another thread's (the
    self-check's engine and a served one never share a plan), and is gone after the block."""
    plan = plan_rows(*_step([(0, 5, True)]))
    seen: list[RowPlan | None] = []
    with active_row_plan(plan):
        assert current_row_plan() is plan
        other = threading.Thread(target=lambda: seen.append(current_row_plan()))
        other.start()
        other.join()
    assert seen == [None] and current_row_plan() is None


@needs_bf16
def test_a_rows_bits_do_not_depend_on_what_else_the_step_holds() -> None:
    """A prompt token's output equals a lone CALL_ROWS-row dense call with it at row ``p % 64``, in
    every step it may be part of; a decode's equals the packed layer's alone."""
    torch.manual_seed(0)
    layer = PackedLinear(quantize_int4(torch.randn(128, 64) * 0.1, 32), torch.randn(128) * 0.1, 32,
                         torch.device("cpu"), torch.bfloat16, "int4 g32")
    layer.set_dense_weight(layer.dequantize())
    assert layer.dense_weight is not None
    x = torch.randn(200, 64).bfloat16()  # row i: the token at position i of a prompt

    def reference(p: int) -> torch.Tensor:
        call = torch.zeros(CALL_ROWS, 64, dtype=torch.bfloat16)
        call[p % CALL_ROWS] = x[p]
        y = F.linear(call, layer.dense_weight)[p % CALL_ROWS]
        return y + layer.bias.to(y.dtype)  # type: ignore[union-attr]

    decode = torch.randn(1, 64).bfloat16()
    decode_alone = layer(decode)[0]
    steps = [  # (start, count) of prompt chunks; with or without a decode first
        [(0, 200)], [(0, 37)], [(37, 100), (0, 20)], [(150, 50), (5, 64), (64, 11)],
    ]
    for chunks in steps:
        for with_decode in (False, True):
            rows = [decode] if with_decode else []
            rows += [x[s:s + n] for s, n in chunks]
            parts = ([(500, 1, False)] if with_decode else []) + [(s, n, True) for s, n in chunks]
            plan = plan_rows(*_step(parts))
            with active_row_plan(plan):
                y = layer(torch.cat(rows))
            offset = 1 if with_decode else 0
            if with_decode:
                assert torch.equal(y[0], decode_alone)
            for s, n in chunks:
                for i in range(n):
                    assert torch.equal(y[offset + i], reference(s + i)), (chunks, with_decode, s + i)
                offset += n
    with active_row_plan(plan_rows(*_step([(0, 5, True)]))):
        assert torch.equal(layer(decode)[0], decode_alone)  # another row count: the plan is not ours


@pytest.mark.skipif(not amx_int4.amx_available(), reason="the AMX int4 kernel needs AMX-BF16")
def test_prompt_tiles_rows_take_the_prompt_kernel_and_their_bits_alone() -> None:
    """With ``prompt_tiles`` (no copy held), the plan's dense rows take ``amx_int4_prompt_mm`` (a
    row's bits as alone, at any count and place) and the others the packed kernel, each as alone."""
    torch.manual_seed(0)
    layer = PackedLinear(quantize_int4(torch.randn(128, 64) * 0.1, 32), torch.randn(128) * 0.1, 32,
                         torch.device("cpu"), torch.bfloat16, "int4 g32")
    assert layer.amx and layer.dense_weight is None
    layer.prompt_tiles = True
    x = torch.randn(200, 64).bfloat16()
    buffers = layer._buffers

    def alone(p: int) -> torch.Tensor:
        y = amx_int4.amx_int4_prompt_mm(x[p:p + 1], buffers["packed0"], buffers["scales_and_zeros0"], 32)[0]
        return y + layer.bias.to(y.dtype)  # type: ignore[union-attr]

    decode = torch.randn(1, 64).bfloat16()
    decode_alone = layer(decode)[0]
    for chunks in ([(0, 200)], [(37, 100), (0, 20)], [(150, 50), (5, 64), (64, 11)]):
        for with_decode in (False, True):
            rows = ([decode] if with_decode else []) + [x[s:s + n] for s, n in chunks]
            parts = ([(500, 1, False)] if with_decode else []) + [(s, n, True) for s, n in chunks]
            with active_row_plan(plan_rows(*_step(parts), by_position=False)):
                y = layer(torch.cat(rows))
            offset = 1 if with_decode else 0
            if with_decode:
                assert torch.equal(y[0], decode_alone)
            for s, n in chunks:
                for i in range(n):
                    assert torch.equal(y[offset + i], alone(s + i)), (chunks, with_decode, s + i)
                offset += n
    assert not torch.equal(alone(3), layer(x[3:4])[0])  # not the packed kernel's bits: its own kind


def _tiny_bf16(copies: torch.dtype | str = torch.bfloat16) -> torch.nn.Module:
    """The tiny Llama with int4 linears and prompt copies in ``copies``, or ``"tiles"``: no copies,
    the AMX int4 layers' prompt-row kernel (``proxy.quant.apply.use_prompt_tiles``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=112, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    if copies == "tiles8":  # Int8Linear keeps fp32 scales: cast the model before, not after
        model.to(torch.bfloat16)
        quantize_linears(model, "int8", 32, torch.bfloat16)
    else:
        quantize_linears(model, "int4", 32, torch.bfloat16)
        model.to(torch.bfloat16)
    if copies in ("tiles", "tiles8"):
        assert use_prompt_tiles(model) == 14  # every linear but the lm_head
    else:
        assert add_dense_weights(model, copies) == 14
    model.set_attn_implementation("sdpa")
    return model.eval()


@needs_bf16
@pytest.mark.parametrize("copies", [torch.bfloat16, torch.float32, "tiles", "tiles8"])
def test_engine_text_does_not_depend_on_chunking_batching_or_the_prefix_cache(
        copies: torch.dtype | str) -> None:
    if copies == torch.float32 and not _fp32_rows_are_invariant():
        pytest.skip("this CPU's fp32 GEMM gives a row other bits at another place in the call")
    tiles = copies in ("tiles", "tiles8")  # the prompt-row kernels of the int4 / int8 AMX layers
    if tiles and not amx_int4.amx_available():
        pytest.skip("the AMX kernels need AMX-BF16")
    model = _tiny_bf16(copies)
    assert has_dense_weights(model) == (not tiles)
    plan = (PrefillPlan.prompt_kernel() if tiles
            else PrefillPlan(str(copies).removeprefix("torch."), 64, copies == torch.bfloat16))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 112, (n,), generator=gen).tolist() for n in (5, 70, 150, 33, 64, 129)]

    def run(budget: int, arrivals: list[int], prefix_caching: bool = True) -> dict[str, list[int]]:
        core = EngineCore(model, Settings(max_num_batched_tokens=budget, max_prefill_step_ratio=0,
                                          num_kv_blocks=256, block_size=16,
                                          enable_prefix_caching=prefix_caching), [2], 512)
        assert core.runner.prefill_plan == plan
        assert core.block_manager.output_blocks_apart
        assert core.scheduler.config.prefill_token_multiple == plan.call_rows
        return run_staggered(core, prompts, params, arrivals)

    alone = {}
    for i, prompt in enumerate(prompts):
        core = EngineCore(model, Settings(num_kv_blocks=256, enable_prefix_caching=False), [2], 512)
        alone[str(i)] = run_staggered(core, [prompt], params, [0])["0"]
    assert run(4096, [0] * 6) == alone  # together
    assert run(23, [0, 1, 1, 4, 9, 9]) == alone  # chunked, staggered, mixed with decodes
    assert run(64, [0, 0, 3, 3, 5, 30], prefix_caching=False) == alone
    # a later prompt that resends an earlier prompt and its answer (a chat turn): the answer's
    # blocks came from the decode path, so they are not served from the cache for it
    turn2 = prompts[2] + alone["2"] + prompts[0]
    core = EngineCore(model, Settings(num_kv_blocks=256, block_size=16), [2], 512)
    first = run_staggered(core, [prompts[2], turn2], params, [0, 40])
    cold = EngineCore(model, Settings(num_kv_blocks=256, enable_prefix_caching=False), [2], 512)
    assert first["1"] == run_staggered(cold, [turn2], params, [0])["0"]
    assert first["0"] == alone["2"]
    assert core.block_manager.num_hit_tokens == 144  # prompts[2]'s 9 full prompt blocks, no more


def test_blocks_holding_output_tokens_hash_apart() -> None:
    tokens = list(range(10, 50))
    answered = Request("a", tokens[:20], SamplingParams(max_tokens=30))
    for t in tokens[20:]:
        answered.append_token(t)
    resent = Request("b", tokens, SamplingParams(max_tokens=5))
    apart = BlockManager(16, 4, output_blocks_apart=True)
    a, b = apart.block_hashes(answered), apart.block_hashes(resent)
    assert a[:5] == b[:5] and all(x != y for x, y in zip(a[5:], b[5:], strict=True))  # 20 prompt tokens
    same = BlockManager(16, 4)
    assert same.block_hashes(Request("c", tokens[:21], SamplingParams())) == b[:5]
    odd = Request("d", tokens[:22], SamplingParams(max_tokens=30))
    for t in tokens[22:]:
        odd.append_token(t)
    assert apart.block_hashes(odd)[:5] == b[:5] and apart.block_hashes(odd)[5] != b[5]  # block 5 mixed


def test_dense_prefill_is_on_by_default_with_amx_or_without_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx512f", "amx_bf16"}))
    assert dense_prefill_default(cpu) and dense_weight_dtype(cpu) == torch.bfloat16
    assert not dense_prefill_default(torch.device("cuda"))
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert not dense_prefill_default(cpu)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert dense_prefill_default(cpu) and dense_weight_dtype(cpu) == torch.float32
