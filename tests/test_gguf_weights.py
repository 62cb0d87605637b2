"""A GGUF's weights read straight from the file (``proxy.models.gguf_weights``, issue 46): every
parameter equals transformers' own GGUF load (gguf-py's dequantization, llama's q/k rows put back in
transformers' order), whole, by rows and in chunks; a GGUF loads packed or dense with no weight file
written to the cache; a weight missing from the file is named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from quant.test_gguf_kquant_model import LOSSLESS, MIXED, T, write_gguf
from quant.test_gguf_kquant_server import _converted_folder

from proxy.engine.loading import load_engine_model
from proxy.models import ModelLoadError
from proxy.models.gguf_weights import GGUFWeights, gguf_weights
from proxy.settings import Settings

CPU = torch.device("cpu")


def _transformers_tensors(path: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict transformers' GGUF loader builds from the file (what the old converted folder held)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    tensors: dict[str, torch.Tensor] = load_gguf_checkpoint(str(path), return_tensors=True,
                                                           model_to_load=model)["tensors"]
    return tensors


def test_every_weight_equals_transformers_load_of_the_file(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "mixed.gguf"
    dense = write_gguf(path, MIXED, norm_noise=0.1)
    want = _transformers_tensors(path, dense)
    assert sorted(want) == sorted(name for name, _ in dense.named_parameters())  # norms included
    weights = GGUFWeights(path, dense, torch.float32, CPU)
    monkeypatch.setattr(GGUFWeights, "CHUNK_ROWS", 24)  # q/k rows permuted across several chunks
    rows = torch.tensor([0, 5, 3, 17, 64, 65, 111])
    for name, tensor in want.items():
        got = weights.full(name)
        assert got.dtype == torch.float32 and torch.equal(got, tensor), name
        assert torch.equal(got, dense.get_parameter(name).detach()), name  # the test's own dequantization
        if tensor.dim() == 2:
            assert torch.equal(weights.rows(name, rows), tensor[rows]), name
    bf16 = GGUFWeights(path, dense, torch.bfloat16, CPU)  # cast once from fp32, as from_pretrained casts
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight", "model.embed_tokens.weight"):
        assert torch.equal(bf16.full(name), want[name].to(torch.bfloat16)), name


def test_a_missing_weight_is_named(tmp_path: Path) -> None:
    path = tmp_path / "one.gguf"
    dense = write_gguf(path, [("model.layers.0.mlp.up_proj", "blk.0.ffn_up", T.Q4_K, 0)])
    weights = gguf_weights(path, dense, torch.float32, CPU)
    with pytest.raises(ModelLoadError, match="'model.layers.0.mlp.down_proj.weight' is missing from"):
        weights.full("model.layers.0.mlp.down_proj.weight")


@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_a_gguf_is_served_from_the_file_without_writing_its_weights(tmp_path: Path,
                                                                    quantization: str) -> None:
    """The cache folder holds the config and tokenizer only, before and after the load; packed
    (``auto``) or dense (``none``), every weight the model holds densely equals the file's values."""
    path = tmp_path / "tiny.gguf"
    dense = write_gguf(path, LOSSLESS, norm_noise=0.1)
    folder = tmp_path / "cache" / "tiny"
    _converted_folder(folder, dense)
    before = sorted(p.name for p in folder.iterdir())
    settings = Settings(model=str(path), cache_dir=str(tmp_path / "cache"), quantization=quantization,
                        dtype="float32", max_model_len=128, num_threads=1)
    loaded = load_engine_model(settings)
    assert sorted(p.name for p in folder.iterdir()) == before
    assert not [p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin")]
    assert loaded.model_path == str(folder) and loaded.gguf_path == str(path)
    want = dict(dense.named_parameters())
    got = dict(loaded.model.named_parameters())
    if quantization == "none":
        assert loaded.quantization == "none" and sorted(got) == sorted(want)
    else:
        assert loaded.quantization.startswith("gguf: Q4_K -> int4 g32 x7"), loaded.quantization
    for name, param in got.items():
        if name in want:  # packed linears hold codes and scales instead
            assert torch.equal(param, want[name].detach()), name
    assert "model.norm.weight" in got and "model.layers.1.post_attention_layernorm.weight" in got
