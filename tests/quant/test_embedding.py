"""proxy.quant.embedding: a GGUF's Q8_0 token embedding served from its int8 codes, equal to the dense
table (gguf-py's dequantization) bit for bit, or left dense when it is not."""

from __future__ import annotations

import copy
from pathlib import Path

import gguf
import torch
from gguf.quants import dequantize, quantize
from torch import nn

from proxy.quant.embedding import Int8Embedding, pack_q8_embedding, q8_0_codes
from proxy.quant.gguf_blocks import load_gguf_linears
from proxy.quant.gguf_file import gguf_tensors

CPU = torch.device("cpu")
T = gguf.GGMLQuantizationType


def _model_and_gguf(tmp_path: Path, qtype: gguf.GGMLQuantizationType) -> tuple[nn.Module, Path]:
    """A tiny llama whose embedding holds the dequantized values of a ``token_embd`` of ``qtype``
    written to a GGUF (with no linears: those stay dense)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=112, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    w = model.model.embed_tokens.weight.detach().numpy() * 3
    data = quantize(w, qtype)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.from_numpy(dequantize(data, qtype).reshape(w.shape)))
    path = tmp_path / "embd.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, path


def test_q8_0_embedding_rows_equal_the_dense_table(tmp_path: Path) -> None:
    dense, path = _model_and_gguf(tmp_path, T.Q8_0)
    model = copy.deepcopy(dense)
    counts = load_gguf_linears(model, path, torch.float32)
    assert counts["token_embd Q8_0 -> int8 g32"] == 1
    layer = model.model.embed_tokens
    assert type(layer) is Int8Embedding and layer.codes.dtype == torch.int8
    assert layer.codes.shape == (112, 64) and layer.scales.shape == (112, 2)
    ids = torch.tensor([[0, 5, 111, 5], [7, 8, 9, 10]])
    with torch.inference_mode():
        assert torch.equal(layer(ids), dense.model.embed_tokens(ids))
        assert torch.equal(model(ids).logits, dense(ids).logits)  # the linears stayed dense here


def test_q8_0_embedding_in_bf16_rounds_the_fp32_product_once(tmp_path: Path) -> None:
    dense, path = _model_and_gguf(tmp_path, T.Q8_0)
    _, tensors = gguf_tensors(path)
    codes, scales = q8_0_codes(tensors["token_embd.weight"].data, (112, 64))
    layer = Int8Embedding(codes, scales, torch.bfloat16)
    ids = torch.arange(112)
    want = dense.model.embed_tokens.weight.detach().to(torch.bfloat16)
    assert layer(ids).dtype == torch.bfloat16 and torch.equal(layer(ids), want)


def test_an_embedding_that_does_not_match_or_is_not_q8_0_stays_dense(tmp_path: Path, caplog) -> None:
    dense, path = _model_and_gguf(tmp_path, T.Q8_0)
    _, tensors = gguf_tensors(path)
    raw = tensors["token_embd.weight"].data
    model = copy.deepcopy(dense)
    with torch.no_grad():
        model.model.embed_tokens.weight[100, 3] += 1e-3  # the folder's table differs from the blocks

    def rows(name: str, ids: torch.Tensor) -> torch.Tensor:
        return model.get_parameter(name).detach()[ids]

    assert not pack_q8_embedding(model, "Q8_0", raw, rows, CPU)
    assert type(model.model.embed_tokens) is nn.Embedding
    assert "does not match the dense table" in caplog.text
    assert not pack_q8_embedding(dense, "Q4_0", raw, rows, CPU)  # only Q8_0 blocks are read here

    (tmp_path / "q4").mkdir()
    other, path4 = _model_and_gguf(tmp_path / "q4", T.Q4_0)
    counts = load_gguf_linears(other, path4, torch.float32)
    assert "token_embd Q8_0 -> int8 g32" not in counts and type(other.model.embed_tokens) is nn.Embedding


def test_a_scaled_embedding_subclass_stays_dense(tmp_path: Path, caplog) -> None:
    dense, path = _model_and_gguf(tmp_path, T.Q8_0)

    class Scaled(nn.Embedding):  # as Gemma's ScaledWordEmbedding: rows times a factor
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) * 8.0

    old = dense.model.embed_tokens
    new = Scaled(old.num_embeddings, old.embedding_dim)
    new.weight = old.weight
    dense.model.embed_tokens = new
    _, tensors = gguf_tensors(path)

    def rows(name: str, ids: torch.Tensor) -> torch.Tensor:
        return dense.get_parameter(name).detach()[ids]

    assert not pack_q8_embedding(dense, "Q8_0", tensors["token_embd.weight"].data, rows, CPU)
    assert type(dense.model.embed_tokens) is Scaled
    with caplog.at_level("INFO"):  # the loader counts it and logs why, with the bytes
        counts = load_gguf_linears(dense, path, torch.float32)
    assert counts["token_embd Q8_0 -> dense"] == 1 and type(dense.model.embed_tokens) is Scaled
    assert ("GGUF token_embd Q8_0 -> dense x1, not at its own precision (the input embedding is not a plain "
            "nn.Embedding, or its rows differ from the file's)") in caplog.text
