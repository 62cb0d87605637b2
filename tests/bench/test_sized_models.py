"""bench/sized_models.py: the shapes are the real models' (parameter counts as published), the
streamed safetensors file is what safetensors and transformers read, and a built folder loads."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("sized_models", REPO / "bench" / "sized_models.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sized_models"] = mod
    spec.loader.exec_module(mod)
    return mod


sized = _load()


def test_parameter_counts_are_the_published_ones() -> None:
    counts = {n: sum(math.prod(s) for _, s in sized.tensor_shapes(sh.config))
              for n, sh in sized.SHAPES.items()}
    assert counts == {"qwen2.5-0.5b": 494_032_768, "smollm2-1.7b": 1_711_376_384,
                      "llama-3.2-3b": 3_212_749_824, "qwen2.5-7b": 7_615_616_512}
    names = {n: [t for t, _ in sized.tensor_shapes(sh.config)] for n, sh in sized.SHAPES.items()}
    assert "lm_head.weight" in names["qwen2.5-7b"] and "lm_head.weight" not in names["llama-3.2-3b"]
    assert "model.layers.0.self_attn.k_proj.bias" in names["qwen2.5-0.5b"]
    assert not any(t.endswith(".bias") for t in names["smollm2-1.7b"])


TINY = {**sized.SHAPES["qwen2.5-0.5b"].config, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 151936,
        "tie_word_embeddings": False}


def test_streamed_safetensors_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors import safe_open

    monkeypatch.setattr(sized, "SLICE_ELEMENTS", 1000)  # many slices per tensor
    path = tmp_path / "model.safetensors"
    sized.write_random_safetensors(TINY, path, seed=3)
    assert not (tmp_path / "model.safetensors.partial").exists()
    shapes = dict(sized.tensor_shapes(TINY))
    with safe_open(str(path), "pt") as f:
        assert set(f.keys()) == set(shapes)
        for name, shape in shapes.items():
            t = f.get_tensor(name)
            assert t.dtype == torch.bfloat16 and tuple(t.shape) == shape
        assert torch.equal(f.get_tensor("model.norm.weight"), torch.ones(64, dtype=torch.bfloat16))
        assert torch.equal(f.get_tensor("model.layers.1.self_attn.v_proj.bias"),
                           torch.zeros(32, dtype=torch.bfloat16))
        embed = f.get_tensor("model.embed_tokens.weight").float()
    assert embed.std().item() == pytest.approx(0.02, rel=0.01)  # 9.7 M draws of N(0, 0.02)
    data = 2 * sum(math.prod(s) for s in shapes.values())
    header = int.from_bytes(path.read_bytes()[:8], "little")
    assert header % 8 == 0 and path.stat().st_size == 8 + header + data
    again = tmp_path / "again.safetensors"
    sized.write_random_safetensors(TINY, again, seed=3)
    assert again.read_bytes() == path.read_bytes()  # seeded: a rebuild is the same file


def test_a_built_folder_loads_in_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("STREAMPROXY_SIZED_DIR", str(tmp_path))
    shape = sized.Shape("test", TINY, "qwen2", "<|im_end|>")
    monkeypatch.setitem(sized.SHAPES, "tiny", shape)
    folder = sized.build_hf("tiny")
    assert folder == tmp_path / "tiny" / "hf"
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 151645
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert tok.eos_token_id == 151645  # the instruct model's end of turn, not the zoo's <|endoftext|>
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
    with torch.inference_mode():
        logits = model(torch.tensor([tok.encode("hi")])).logits
    assert logits.shape[-1] == 151936 and torch.isfinite(logits).all()
    assert sized.build_hf("tiny") == folder  # built once


def test_added_tokens_past_the_vocabulary_are_dropped(tmp_path: Path) -> None:
    """The zoo's Llama 3 tokenizer has an ``<|endoftext|>`` at 128256, one past Llama 3's 128256-token
    vocabulary; the converter asserts every id is below ``vocab_size``."""
    shape = sized.SHAPES["llama-3.2-3b"]
    sized.write_small_files(shape, tmp_path)
    added = json.loads((tmp_path / "tokenizer.json").read_text())["added_tokens"]
    assert max(t["id"] for t in added) == 128255
    assert "<|endoftext|>" not in {t["content"] for t in added}
    assert (tmp_path / "chat_template.jinja").read_text() == sized.LLAMA3_CHAT_TEMPLATE
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"] == "<|eot_id|>"
