"""proxy.quant.skinny: dense fp32 CPU linears compute calls of 2..MAX_SWAPPED_ROWS rows as W @ x^T."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from proxy.quant import PackedLinear, quantize_linears, skinny
from proxy.quant.int8_linear import Int8Linear
from proxy.quant.skinny import MAX_SWAPPED_ROWS, SkinnyLinear, use_skinny_linears


def _linear(bias: bool) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(96, 160, bias=bias)


def _skinny(base: nn.Linear) -> nn.Module:
    module = copy.deepcopy(base)
    assert use_skinny_linears(module) == 1 and type(module) is SkinnyLinear
    return module


@pytest.fixture
def linear_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Row counts of the calls SkinnyLinear hands to F.linear."""
    calls: list[int] = []

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(x.numel() // x.shape[-1])
        return F.linear(x, w, b)

    monkeypatch.setattr(skinny, "F", types.SimpleNamespace(linear=linear))
    return calls


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 96), (1, 2, 96), (2, 5, 96), (1, MAX_SWAPPED_ROWS, 96),
                                   (1, MAX_SWAPPED_ROWS + 1, 96), (3, 96), (96,)])
def test_equals_the_linear_and_takes_the_swapped_form_for_few_rows(
        shape: tuple[int, ...], bias: bool, linear_calls: list[int]) -> None:
    base = _linear(bias)
    module = _skinny(base)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        y = module(x)
        ref = base(x)
    rows = x.numel() // 96
    assert y.shape == ref.shape == (*shape[:-1], 160) and y.is_contiguous() and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    swapped = 2 <= rows <= MAX_SWAPPED_ROWS
    assert linear_calls == ([] if swapped else [rows])
    if swapped:  # the swapped product, bit for bit
        x_t = x.reshape(rows, 96).T
        expected = (torch.addmm(base.bias[:, None], base.weight, x_t) if bias else base.weight @ x_t).T
        assert torch.equal(y.reshape(rows, 160), expected)


def test_a_non_contiguous_input() -> None:
    base = _linear(True)
    x = torch.randn(5, 192, generator=torch.Generator().manual_seed(3))[:, ::2]
    assert not x.is_contiguous()
    with torch.inference_mode():
        torch.testing.assert_close(_skinny(base)(x), base(x), rtol=1e-5, atol=1e-5)


def test_the_module_is_turned_in_place_keeping_its_state() -> None:
    module = _linear(True).eval()
    weight, bias, keys = module.weight, module.bias, module.state_dict().keys()
    seen: list[tuple[int, ...]] = []
    module.register_forward_hook(lambda _m, _args, out: seen.append(tuple(out.shape)))
    assert use_skinny_linears(module) == 1
    assert type(module) is SkinnyLinear and not module.training
    assert module.weight is weight and module.bias is bias and module.state_dict().keys() == keys
    with torch.inference_mode():
        module(torch.zeros(3, 96))
    assert seen == [(3, 160)]  # hooks kept


def _tiny_llama(tie: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=112, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("tie", [True, False])
def test_swaps_every_fp32_cpu_linear_keeps_ties_and_the_logits(tie: bool) -> None:
    model = _tiny_llama(tie)
    ids = torch.randint(0, 112, (3, 7), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        before = model(ids).logits
    keys = model.state_dict().keys()
    assert use_skinny_linears(model) == 2 * 7 + 1  # q, k, v, o, gate, up, down a layer; the lm_head
    assert all(type(m) is not nn.Linear for m in model.modules())
    assert type(model.lm_head) is SkinnyLinear
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    assert model.state_dict().keys() == keys
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-4, atol=1e-4)
    assert use_skinny_linears(model) == 0  # idempotent


#: the packed layer types (int8 g32 is an Int8Linear where the Q8_0 kernel runs)
PACKED = (PackedLinear, Int8Linear)


def test_leaves_other_dtypes_and_packed_linears_alone() -> None:
    model = _tiny_llama(False).to(torch.bfloat16)
    assert use_skinny_linears(model) == 0
    packed = _tiny_llama(False)
    quantize_linears(packed, "int8", 32, torch.float32)
    num_packed = sum(type(m) in PACKED for m in packed.modules())
    num_plain = sum(type(m) is nn.Linear for m in packed.modules())
    assert num_packed > 0 and num_packed + num_plain == 15
    assert use_skinny_linears(packed) == num_plain
    assert sum(type(m) in PACKED for m in packed.modules()) == num_packed


def test_quantization_after_the_swap_still_packs_every_linear() -> None:
    """proxy.quant.apply.named_linears sees skinny linears as dense ones."""
    reference, model = _tiny_llama(False), _tiny_llama(False)
    use_skinny_linears(model)
    counts = quantize_linears(reference, "int8", 32, torch.float32)
    assert quantize_linears(model, "int8", 32, torch.float32) == counts
    assert sum(type(m) in PACKED for m in model.modules()) == sum(
        type(m) in PACKED for m in reference.modules()) > 0
