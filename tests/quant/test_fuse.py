"""proxy.quant.fuse: q/k/v and gate/up packed siblings as one matmul, bit for bit the separate layers."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from proxy.quant import PackedLinear, kernel_dtype, quantize_linears
from proxy.quant.fuse import FusedSlice, fuse_sibling_linears
from proxy.quant.int8_linear import Int8Linear, kernel_available

CPU = torch.device("cpu")


def _tiny(arch: str, method: str) -> nn.Module:
    """A tiny random llama or qwen2 (q/k/v with biases), every linear packed; head_dim 64, so
    every projection has a multiple of 64 rows (the CPU layout's row block)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = {"vocab_size": 112, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 256,
           "tie_word_embeddings": False}
    model = LlamaForCausalLM(LlamaConfig(**cfg)) if arch == "llama" else Qwen2ForCausalLM(Qwen2Config(**cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)
    quantize_linears(model, method, 32, kernel_dtype(CPU))
    model.set_attn_implementation("sdpa")
    return model.eval()


@pytest.mark.parametrize(("arch", "method"), [("llama", "int4"), ("llama", "int8"), ("qwen2", "int4")])
def test_fused_model_equals_the_separate_layers_bit_for_bit(arch: str, method: str) -> None:
    model = _tiny(arch, method)
    fused = copy.deepcopy(model)
    assert fuse_sibling_linears(fused) == 4  # 2 layers x (q/k/v, gate/up)
    attn = fused.model.layers[0].self_attn
    mlp = fused.model.layers[0].mlp
    assert isinstance(attn.q_proj, FusedSlice) and isinstance(mlp.up_proj, FusedSlice)
    layer_type = Int8Linear if method == "int8" and kernel_available() else PackedLinear  # the Q8_0 kernel
    assert type(attn.fused_q_proj_k_proj_v_proj) is layer_type
    assert attn.fused_q_proj_k_proj_v_proj.out_features == 128 + 64 + 64
    assert (attn.k_proj.start, attn.k_proj.stop, attn.v_proj.out_features) == (128, 192, 64)
    assert (attn.fused_q_proj_k_proj_v_proj.bias is None) == (arch == "llama")
    assert type(mlp.fused_gate_proj_up_proj) is layer_type and type(mlp.down_proj) is layer_type
    ids = torch.randint(0, 112, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, fused(ids).logits)
        a = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        b = fused.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)


def test_a_sibling_called_with_another_input_or_twice_recomputes() -> None:
    model = _tiny("llama", "int4")
    attn = model.model.layers[0].self_attn
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    fuse_sibling_linears(model)
    fq, fk, fv = attn.q_proj, attn.k_proj, attn.v_proj
    g = torch.Generator().manual_seed(2)
    x1, x2 = torch.randn(3, 128, generator=g), torch.randn(3, 128, generator=g)
    with torch.inference_mode():
        assert torch.equal(fq(x1), q(x1))
        assert torch.equal(fk(x2), k(x2))  # not x1's cached result
        assert torch.equal(fk(x2), k(x2))  # twice: recomputed, same value
        assert torch.equal(fv(x1), v(x1))
        assert torch.equal(fq(x1), q(x1))
    shared = fq._shared
    assert shared.x is x1 and shared.pending == 1 << 1  # k (bit 1) has yet to take x1's columns
    fk(x1)
    assert shared.x is None and shared.y is None  # every sibling served: references dropped


def test_groups_with_a_dense_or_different_sibling_stay_separate() -> None:
    model = _tiny("llama", "int4")
    layer0, layer1 = model.model.layers
    layer0.self_attn.v_proj = nn.Linear(128, 64, bias=False)  # dense sibling
    gate = layer1.mlp.gate_proj
    layer1.mlp.gate_proj = PackedLinear.concat([gate])  # same values, other group size below
    layer1.mlp.gate_proj.group_size = 64
    separate = copy.deepcopy(model)
    assert fuse_sibling_linears(model) == 3  # layer 0 q/k and gate/up, layer 1 q/k/v
    attn0 = layer0.self_attn
    assert isinstance(attn0.q_proj, FusedSlice) and isinstance(attn0.k_proj, FusedSlice)
    assert type(attn0.v_proj) is nn.Linear and attn0.fused_q_proj_k_proj.out_features == 128 + 64
    assert isinstance(layer0.mlp.gate_proj, FusedSlice)
    assert isinstance(layer1.self_attn.q_proj, FusedSlice) and type(layer1.mlp.up_proj) is PackedLinear
    ids = torch.randint(0, 112, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, separate(ids).logits)


def test_projections_of_32_rows_are_not_fused() -> None:
    """The CPU layout packs rows in blocks of 64: a 32-row part would not concatenate (measured:
    wrong values), so such a group stays separate."""
    from proxy.quant.linear import quantize_int4

    def packed(n: int) -> PackedLinear:
        return PackedLinear(quantize_int4(torch.randn(n, 64), 32), None, 32, CPU, kernel_dtype(CPU), "int4")

    parent = nn.Module()
    parent.q_proj, parent.k_proj, parent.v_proj = packed(64), packed(32), packed(32)
    parent.gate_proj, parent.up_proj = packed(64), packed(64)
    assert fuse_sibling_linears(parent) == 1
    assert type(parent.q_proj) is PackedLinear and isinstance(parent.up_proj, FusedSlice)


def test_each_groups_parts_are_freed_before_the_next_group(monkeypatch) -> None:
    """The replaced parts (and any dense copies they hold) are garbage once their group is fused:
    at the heap trim after each group, no part of an earlier group is alive (a list of every
    module kept them all to the end: 175 MB of the default model's load RSS peak)."""
    import gc
    import weakref

    from proxy.quant import fuse

    model = _tiny("llama", "int4")
    groups = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        groups += [[weakref.ref(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj)],
                   [weakref.ref(m) for m in (mlp.gate_proj, mlp.up_proj)]]
    alive_at_trim: list[int] = []

    def trim() -> None:
        gc.collect()
        fused_so_far = groups[:len(alive_at_trim) + 1]  # fused in module order
        alive_at_trim.append(sum(r() is not None for g in fused_so_far for r in g))

    monkeypatch.setattr(fuse, "trim_heap", trim)
    assert fuse_sibling_linears(model) == 4
    assert alive_at_trim == [0, 0, 0, 0]
