"""proxy.quant.gguf_file and proxy.quant.gguf_blocks: the header index against gguf-py's reader,
Q4_0/Q4_1/Q8_0 blocks decoded into packed layers whose weights equal gguf-py's dequantization
exactly, and a whole (tiny) llama's linears loaded from a GGUF written here, RoPE row order included."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from torch import nn

from proxy.quant.fuse import fuse_sibling_linears
from proxy.quant.gguf_blocks import decode_blocks, load_gguf_linears
from proxy.quant.gguf_file import gguf_tensors
from proxy.quant.int8_linear import Int8Linear, kernel_available
from proxy.quant.linear import PackedLinear

CPU = torch.device("cpu")
T = gguf.GGMLQuantizationType


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row permute of q/k (the inverse of what transformers undoes)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_order(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=112, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


# (HF module, GGUF tensor, GGML type, RoPE heads or 0)
LAYOUT = [
    ("model.layers.0.self_attn.q_proj", "blk.0.attn_q", T.Q4_1, 4),
    ("model.layers.0.self_attn.k_proj", "blk.0.attn_k", T.Q4_0, 2),
    ("model.layers.0.self_attn.v_proj", "blk.0.attn_v", T.Q8_0, 0),
    ("model.layers.0.self_attn.o_proj", "blk.0.attn_output", T.F32, 0),
    ("model.layers.0.mlp.gate_proj", "blk.0.ffn_gate", T.Q4_1, 0),
    ("model.layers.0.mlp.up_proj", "blk.0.ffn_up", T.Q8_0, 0),
    ("model.layers.0.mlp.down_proj", "blk.0.ffn_down", T.Q5_1, 0),
    ("lm_head", "output", T.Q8_0, 0),
]


def _write_gguf(
    path: Path, layout: list[tuple[str, str, int, int]]
) -> tuple[nn.Module, dict[str, np.ndarray]]:
    """Write ``layout``'s tensors of a tiny llama to ``path``; the dense model with the GGUF's values."""
    model = _tiny_llama()
    writer = gguf.GGUFWriter(str(path), "llama")
    values = {}
    for hf_name, name, qtype, heads in layout:
        w = model.get_submodule(hf_name).weight.detach().numpy() * 3
        stored = _llama_cpp_permute(w, heads) if heads else w
        data = stored.astype(np.float32) if qtype == T.F32 else quantize(stored, qtype)
        writer.add_tensor(f"{name}.weight", data, raw_dtype=qtype)
        deq = stored if qtype == T.F32 else dequantize(data, qtype).reshape(stored.shape)
        values[name] = deq
        with torch.no_grad():
            model.get_submodule(hf_name).weight.copy_(
                torch.from_numpy(_hf_order(deq, heads) if heads else deq)
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, values


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, nn.Module, dict[str, np.ndarray]]:
    """A GGUF of a tiny llama's linears and the dense model transformers would load from it
    (weights = the GGUF's dequantized values, q/k rows back in HF order)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    model, values = _write_gguf(path, LAYOUT)
    return path, model, values


def test_header_index_matches_gguf_reader(tiny_gguf) -> None:
    path, _, _ = tiny_gguf
    arch, tensors = gguf_tensors(path)
    reader = gguf.GGUFReader(str(path))
    assert arch == "llama"
    assert set(tensors) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        mine = tensors[t.name]
        assert mine.type_name == t.tensor_type.name
        assert mine.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert np.array_equal(
            np.asarray(mine.data).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1)
        )


@pytest.mark.parametrize("name", ["blk.0.attn_q", "blk.0.attn_k", "blk.0.attn_v"])
def test_blocks_decode_to_gguf_values_exactly(tiny_gguf, name) -> None:
    """Q4_1 / Q4_0 / Q8_0: the fp32 kernel's weights equal gguf-py's dequantization bit for bit."""
    path, _, values = tiny_gguf
    _, tensors = gguf_tensors(path)
    t = tensors[f"{name}.weight"]
    planes = decode_blocks(t.type_name, t.data, t.shape)
    layer = PackedLinear(planes, None, 32, CPU, torch.float32, t.type_name)
    assert torch.equal(layer.dequantize(), torch.from_numpy(values[name]))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["blk.3.ffn_down.weight", "token_embd.weight"])
def test_default_model_blocks_decode_exactly(name) -> None:
    """The shipped model's own Q4_1 and Q8_0 tensors (first 256 rows: the fp32 kernel is slow)."""
    from proxy.models import default_gguf_path

    t = gguf_tensors(default_gguf_path())[1][name]
    rows = t.data[:256]
    planes = decode_blocks(t.type_name, rows, (256, t.shape[1]))
    layer = PackedLinear(planes, None, 32, CPU, torch.float32, t.type_name)
    ref = dequantize(np.asarray(rows), T[t.type_name]).reshape(256, t.shape[1])
    assert torch.equal(layer.dequantize(), torch.from_numpy(ref))


def test_load_gguf_linears_each_type_and_rope_order(tiny_gguf, caplog) -> None:
    path, dense, _ = tiny_gguf
    import copy

    model = copy.deepcopy(dense)
    with caplog.at_level("INFO"):
        counts = load_gguf_linears(model, path, torch.float32)
    kernel = kernel_available()  # Q5_1's zeros: the int8 kernel's layout; re-quantized without it
    q5_1 = "Q5_1 -> int8 g32" if kernel else "Q5_1 -> int8 g32 (re-quantized)"
    assert counts == Counter({"Q4_1 -> int4 g32": 2, "Q8_0 -> int8 g32": 3, "Q4_0 -> int4 g32": 1,
                              "F32 -> dense": 1, q5_1: 1})
    assert ("GGUF Q5_1 -> int8 g32 (re-quantized) x1, not at its own precision" in caplog.text) != kernel
    int8_type = Int8Linear if kernel_available() else PackedLinear  # the Q8_0 kernel where it runs
    for hf_name, _, qtype, _ in LAYOUT:
        layer = model.get_submodule(hf_name)
        if qtype in (T.Q8_0, T.Q5_1):
            assert type(layer) is int8_type, hf_name
        ref = dense.get_submodule(hf_name).weight.detach()
        if qtype == T.F32:
            assert type(layer) is nn.Linear
        elif qtype == T.Q5_1 and not kernel:
            assert (layer.dequantize() - ref).abs().max() <= ref.abs().max() / 127 * 0.51
        else:  # lossless, rows in HF order
            assert torch.equal(layer.dequantize(), ref), hf_name
    ids = torch.tensor([[1, 5, 9, 20]])
    with torch.inference_mode():
        a, b = model(ids).logits, dense(ids).logits
    assert torch.allclose(a, b, atol=0.05), (a - b).abs().max()


def _rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status")
def test_release_drops_the_read_pages_and_the_bytes_stay_readable() -> None:
    """The shipped model's token_embd (30 MB of Q8_0 blocks): reading it maps its pages into the
    RSS; ``release`` takes them out again (within 1 MiB), and a later read sees the same bytes."""
    from proxy.models import default_gguf_path

    t = gguf_tensors(default_gguf_path())[1]["token_embd.weight"]
    assert t.mapping is not None and t.data.nbytes > 16 << 20
    before = _rss_file_kib()
    digest = int(np.asarray(t.data, dtype=np.uint8).sum(dtype=np.uint64))  # touches every page
    assert _rss_file_kib() - before > t.data.nbytes // 1024 - 1024
    t.release()
    assert _rss_file_kib() - before < 1024
    assert int(np.asarray(t.data, dtype=np.uint8).sum(dtype=np.uint64)) == digest


#: every linear Q8_0 (q/k as llama.cpp permutes them) but down_proj, Q5_1 (int8 codes with zeros)
Q8_LAYOUT = [(hf, name, T.Q5_1 if "down" in hf else T.Q8_0, heads) for hf, name, _, heads in LAYOUT]


@pytest.mark.skipif(not kernel_available(), reason="the Q8_0 kernel needs x86-64 with AVX2 and FMA")
def test_a_q8_0_gguf_serves_every_layer_through_the_q8_kernel(tmp_path: Path) -> None:
    """A Q8_0 GGUF (the common 8-bit download): every layer an Int8Linear with the GGUF's values in
    HF row order (the permuted q/k found as for planes), the siblings fused bit for bit, and
    logits within fp32 summation order of the dense model's."""
    path = tmp_path / "q8.gguf"
    dense, _ = _write_gguf(path, Q8_LAYOUT)
    import copy

    model = copy.deepcopy(dense)
    counts = load_gguf_linears(model, path, torch.bfloat16)
    assert counts == Counter({"Q8_0 -> int8 g32": 7, "Q5_1 -> int8 g32": 1})
    for hf_name, _, _, _ in Q8_LAYOUT:
        layer = model.get_submodule(hf_name)
        ref = dense.get_submodule(hf_name).weight.detach()
        assert type(layer) is Int8Linear, hf_name
        assert torch.equal(layer.dequantize(), ref), hf_name
    ids = torch.tensor([[1, 5, 9, 20, 7]])
    with torch.inference_mode():
        separate = model(ids).logits
        assert fuse_sibling_linears(model) == 2  # q/k/v and gate/up
        attn = model.model.layers[0].self_attn
        assert type(attn.fused_q_proj_k_proj_v_proj) is Int8Linear
        assert torch.equal(model(ids).logits, separate)
        want = dense(ids).logits
    assert (separate - want).abs().max() < 1e-4  # the same weights; fp32 summation order
