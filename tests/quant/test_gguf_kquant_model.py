"""A tiny llama written as a GGUF of K-quant / IQ4 / Q5_0 tensors (as a Q4_K_M file mixes them): each
linear served at its own type (the weights equal gguf-py's dequantization), the types without a layout
re-quantized and logged with their reason and bytes, and the engine's greedy text equal to
``generate()`` of the dense model holding the file's values."""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from engine.engine_helpers import assert_greedy_matches, reference_greedy, run_staggered
from gguf.quants import dequantize, quantize
from torch import nn

from proxy.engine.core import EngineCore
from proxy.engine.execution.attention import register
from proxy.quant import kernel_dtype
from proxy.quant.embedding import Int8Embedding
from proxy.quant.gguf_blocks import load_gguf_linears
from proxy.quant.int8_linear import Int8Linear, kernel_available
from proxy.quant.linear import PackedLinear
from proxy.sampling import SamplingParams
from proxy.settings import Settings
from quant.test_gguf import _hf_order
from quant.test_gguf_types import random_blocks

T = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
EOS = 2
#: fp16 ``d`` ranges that give weights of a few hundredths (the codes and sub-block scales are random)
D_RANGE = {T.Q4_K: (5e-5, 1.5e-4), T.Q5_K: (2e-5, 6e-5), T.Q6_K: (5e-6, 1.5e-5), T.IQ4_NL: (2e-4, 6e-4),
           T.IQ4_XS: (1e-5, 2e-5), T.Q2_K: (5e-4, 1.5e-3)}


def _tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=112, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _blocks(qtype: T, shape: tuple[int, int], seed: int) -> np.ndarray:
    if qtype in (T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_0):  # gguf-py quantizes these
        return quantize(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.05, qtype)
    raw = random_blocks(qtype, *shape, seed=seed)
    lo, hi = D_RANGE[qtype]  # rescale d (and dmin with it) into the type's range
    nbytes = gguf.GGML_QUANT_SIZES[qtype][1]
    r = raw.reshape(shape[0], -1, nbytes)
    at = {T.Q6_K: 208, T.Q2_K: 80}.get(qtype, 0)
    for off in (at, at + 2) if qtype in (T.Q4_K, T.Q5_K, T.Q2_K) else (at,):
        v = r[..., off:off + 2].copy().view(np.float16).astype(np.float32) / 4e-4 * hi
        r[..., off:off + 2] = np.maximum(v, lo).astype(np.float16).view(np.uint8)
    return r.reshape(shape[0], -1)


def write_gguf(path: Path, layout: list[tuple[str, str, T, int]], norm_noise: float = 0.0) -> nn.Module:
    """``layout``: (HF module, GGUF tensor, type, RoPE heads or 0). The norms are written as F32
    (``norm_noise``: their weights 1 + that much noise), with the config's metadata, so that the file
    holds every weight a load from the file alone needs. Returns the dense model holding the GGUF's
    dequantized values (q/k rows back in HF order), as transformers would load it."""
    model = _tiny_llama()
    writer = gguf.GGUFWriter(str(path), "llama")
    config = model.config
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    for i, (hf_name, name, qtype, heads) in enumerate(layout):
        module = model.get_submodule(hf_name)
        shape = tuple(module.weight.shape)
        raw = _blocks(qtype, shape, seed=i)
        writer.add_tensor(f"{name}.weight", raw, raw_dtype=qtype)
        stored = dequantize(raw, qtype).reshape(shape)
        with torch.no_grad():
            module.weight.copy_(torch.from_numpy(_hf_order(stored, heads) if heads else stored))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    g = torch.Generator().manual_seed(3)
    for hf_name, module in model.named_modules():
        if "norm" in type(module).__name__.lower():
            with torch.no_grad():
                module.weight.add_(torch.randn(module.weight.shape, generator=g) * norm_noise)
            writer.add_tensor(f"{names.get_name(hf_name)}.weight", module.weight.detach().numpy().copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def _layer(i: int, types: tuple[T, ...]) -> list[tuple[str, str, T, int]]:
    hf = [f"model.layers.{i}.{n}" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                            "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                            "mlp.down_proj")]
    gg = [f"blk.{i}.{n}"
          for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    heads = (4, 2, 0, 0, 0, 0, 0)
    return list(zip(hf, gg, types, heads, strict=True))


#: Q4_K_M's pattern (Q4_K, Q6_K for attn_v / ffn_down / output) and the other types in layer 1 (Q2_K:
#: a type without a layout here)
MIXED = [
    *_layer(0, (T.Q4_K, T.Q4_K, T.Q6_K, T.Q4_K, T.Q4_K, T.Q4_K, T.Q6_K)),
    *_layer(1, (T.IQ4_XS, T.Q5_0, T.IQ4_NL, T.Q4_K, T.Q5_K, T.Q2_K, T.Q5_1)),
    ("lm_head", "output", T.Q6_K, 0),
    ("model.embed_tokens", "token_embd", T.Q4_K, 0),
]


def test_each_type_served_at_its_own_precision_or_logged(tmp_path: Path, caplog) -> None:
    path = tmp_path / "mixed.gguf"
    dense = write_gguf(path, MIXED)
    model = copy.deepcopy(dense)
    with caplog.at_level("INFO"):
        counts = load_gguf_linears(model, path, torch.float32)
    kernel = kernel_available()  # groups of 16 and zeros run on the int8 kernel only
    assert counts == Counter({
        "Q4_K -> int4 g32": 6, "IQ4_XS -> int8 g32": 1, "Q5_0 -> int8 g32": 1, "IQ4_NL -> int8 g32": 1,
        "Q6_K -> int8 g16" if kernel else "Q6_K -> int8 g32 (re-quantized)": 3,
        "Q5_K -> int8 g32" if kernel else "Q5_K -> int8 g32 (re-quantized)": 1,
        "Q5_1 -> int8 g32" if kernel else "Q5_1 -> int8 g32 (re-quantized)": 1,
        "Q2_K -> int8 g32 (re-quantized)": 1, "token_embd Q4_K -> int8 g32": 1,
    })
    int8_type = Int8Linear if kernel else PackedLinear
    exact = (T.Q4_K, T.IQ4_XS, T.Q5_0, T.IQ4_NL) + ((T.Q6_K, T.Q5_K, T.Q5_1) if kernel else ())
    for hf_name, _, qtype, _ in MIXED[:-1]:
        layer = model.get_submodule(hf_name)
        want = dense.get_submodule(hf_name).weight.detach()
        if qtype == T.Q4_K:
            assert type(layer) is PackedLinear and layer.num_planes == 1, hf_name
        else:
            assert type(layer) is int8_type, hf_name
        if qtype in exact:  # the file's values, rows in HF order
            assert torch.equal(layer.dequantize(), want), hf_name
        else:
            assert not torch.equal(layer.dequantize(), want), hf_name
    embed = model.model.embed_tokens
    assert type(embed) is Int8Embedding and embed.zeros is not None  # Q4_K's -dmin * m
    ids = torch.arange(112)
    with torch.inference_mode():
        assert torch.equal(embed(ids), dense.model.embed_tokens(ids))
    up = model.model.layers[1].mlp.up_proj  # Q2_K
    file_mib = 512 * 84 / (1 << 20)
    served_mib = sum(t.nbytes for t in (*up.parameters(), *up.buffers())) / (1 << 20)
    assert (f"GGUF Q2_K -> int8 g32 (re-quantized) x1, not at its own precision (no packed layout holds "
            f"Q2_K blocks here): {file_mib:.1f} MiB in the file, {served_mib:.1f} MiB served "
            f"(+{served_mib - file_mib:.1f} MiB)") in caplog.text


@pytest.mark.skipif(not kernel_available(), reason="Q6_K's groups of 16 run on the int8 kernel only")
def test_a_tied_q6_k_embedding_is_served_from_the_lm_heads_codes(tmp_path: Path) -> None:
    """A Q4_K_M file of a model with tied embeddings stores ``token_embd`` as Q6_K: the lm_head is an
    int8 g16 layer of its codes, and the input embedding looks up the same tensors."""
    path = tmp_path / "tied.gguf"
    dense = write_gguf(path, [("lm_head", "token_embd", T.Q6_K, 0)])
    with torch.no_grad():
        dense.model.embed_tokens.weight.copy_(dense.lm_head.weight)
    dense.lm_head.weight = dense.model.embed_tokens.weight
    dense.config.tie_word_embeddings = True
    model = copy.deepcopy(dense)
    counts = load_gguf_linears(model, path, torch.float32)
    assert counts["Q6_K -> int8 g16"] == 1 and counts["token_embd Q6_K -> int8 g16"] == 1
    head, embed = model.lm_head, model.model.embed_tokens
    assert type(head) is Int8Linear and head.tied_embedding and head.codes is embed.codes
    ids = torch.arange(112)
    with torch.inference_mode():
        assert torch.equal(embed(ids), dense.model.embed_tokens(ids))
        assert torch.equal(head.dequantize(), dense.lm_head.weight)


#: the lossless types only, so that the served weights are the dense model's (Q4_K_M's pattern in layer 0)
LOSSLESS = [
    *_layer(0, (T.Q4_K, T.Q4_K, T.Q6_K, T.Q4_K, T.Q4_K, T.Q4_K, T.Q6_K)),
    *_layer(1, (T.IQ4_XS, T.Q5_0, T.IQ4_NL, T.Q4_K, T.Q5_K, T.Q5_1, T.Q4_K)),
    ("lm_head", "output", T.Q6_K, 0),
    ("model.embed_tokens", "token_embd", T.Q4_K, 0),
]


@pytest.fixture
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(not kernel_available(), reason="Q6_K / Q5_K / Q5_1 run on the int8 kernel only")
def test_engine_greedy_equals_generate_on_the_files_values(tmp_path: Path, one_torch_thread) -> None:
    """The served kernels (bf16 activations on the int4 kernel, its scale and zero rounded to bf16;
    fp32 on the int8 kernel) against fp32 ``generate()`` on the GGUF's dequantized weights: token for
    token, a divergence accepted only at a near-tie of the reference."""
    path = tmp_path / "lossless.gguf"
    dense = write_gguf(path, LOSSLESS)
    model = copy.deepcopy(dense)
    counts = load_gguf_linears(model, path, kernel_dtype(CPU))
    assert counts == Counter({"Q4_K -> int4 g32": 7, "Q6_K -> int8 g16": 3, "IQ4_NL -> int8 g32": 1,
                              "IQ4_XS -> int8 g32": 1, "Q5_0 -> int8 g32": 1, "Q5_K -> int8 g32": 1,
                              "Q5_1 -> int8 g32": 1, "token_embd Q4_K -> int8 g32": 1})
    model.set_attn_implementation(register())
    dense.set_attn_implementation("sdpa")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 112, (n,), generator=g).tolist() for n in (5, 17, 9)]
    core = EngineCore(model, Settings(num_kv_blocks=32, block_size=4, max_num_batched_tokens=16), [EOS],
                      max_model_len=128)
    results = run_staggered(core, prompts, SamplingParams(max_tokens=16, temperature=0.0), [0, 1, 3])
    distinct = set()
    for i, p in enumerate(prompts):
        ref_ids, gaps = reference_greedy(dense, p, 16, EOS)
        # the bf16 path's logits differ from fp32 by up to 0.02 here (measured): 0.05 is a near-tie
        assert_greedy_matches(results[str(i)], ref_ids, gaps, f"prompt {i}", tolerance=0.05)
        distinct.add(tuple(ref_ids))
    assert len(distinct) > 1


@pytest.mark.skipif(not kernel_available(), reason="the int8 kernel's zeros hold such a Q4_K tensor")
def test_a_q4_k_tensor_whose_zero_would_round_is_served_as_int8_codes_with_zeros(tmp_path: Path) -> None:
    """``dmin`` thousands of times ``d``: ``8 d sc - dmin m`` needs more than fp32's 24 bits, so the
    int4 plane would miss the file's values by an ulp; the loader serves the tensor as int8 codes with
    a zero per group instead, exactly."""
    model = _tiny_llama()
    raw = random_blocks(T.Q4_K, 512, 256, seed=5, dmin_ratio=(3000.0, 6000.0))
    path = tmp_path / "far.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_gate.weight", raw, raw_dtype=T.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with torch.no_grad():
        gate = torch.from_numpy(dequantize(raw, T.Q4_K).reshape(512, 256))
        model.model.layers[0].mlp.gate_proj.weight.copy_(gate)
    dense = copy.deepcopy(model)
    counts = load_gguf_linears(model, path, torch.float32)
    assert counts["Q4_K -> int8 g32"] == 1 and "Q4_K -> int4 g32" not in counts
    layer = model.model.layers[0].mlp.gate_proj
    assert type(layer) is Int8Linear and layer.zeros is not None
    assert torch.equal(layer.dequantize(), dense.model.layers[0].mlp.gate_proj.weight)
