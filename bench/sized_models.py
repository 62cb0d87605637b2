"""Random-weight models of the shapes people run, built offline: Hugging Face folders and their GGUFs.

Speed does not depend on the weights' values (a benchmark generates with ``ignore_eos``), so a model
with a real model's shape, tokenizer and file types measures what that model would. Each shape below
is the real model's ``config.json`` (its numbers copied into :data:`SHAPES`, the source named there):

| name | real model | attention | embeddings |
|---|---|---|---|
| ``qwen2.5-0.5b`` | Qwen/Qwen2.5-0.5B-Instruct | GQA 14 / 2 heads | tied |
| ``smollm2-1.7b`` | HuggingFaceTB/SmolLM2-1.7B-Instruct | MHA 32 heads | tied |
| ``llama-3.2-3b`` | meta-llama/Llama-3.2-3B-Instruct | GQA 24 / 8 heads | tied |
| ``qwen2.5-7b`` | Qwen/Qwen2.5-7B-Instruct | GQA 28 / 4 heads | separate ``lm_head`` |

What is built, per shape, under ``$STREAMPROXY_SIZED_DIR`` (default ``~/.cache/streamproxy-bench/
sized-models``; not under ``~/.cache/streamproxy``, whose folders ``compare.py`` searches for the
default model), each file written under a temporary name and renamed once complete, so a rerun
finds it and returns at once:

- ``<name>/hf/``: ``config.json`` and ``generation_config.json`` from the shape; ``model.safetensors``
  of random bf16 weights (normal, std ``initializer_range``; norms 1; biases 0), written one tensor
  (and one slice of a large tensor) at a time, so memory holds one slice, never the model; the
  tokenizer: Qwen2's and Llama 3's from the test suite's tokenizer zoo (``tests/testdata.py``, real
  tokenizers converted from the vocab GGUFs llama.cpp ships), SmolLM2's from the default model's
  converted folder (``bench/compare.py``'s ``hf_folder``); a chat template in the real model's format
  (ChatML for Qwen2 and SmolLM2, from the tokenizer's folder; Llama 3's header format,
  :data:`LLAMA3_CHAT_TEMPLATE`), without the real templates' tool and default-system parts. The zoo's
  Llama 3 tokenizer adds no BOS of its own (the template writes it), so the converter names its
  pre-tokenizer ``smaug-bpe`` (llama.cpp splits it by the same rule as ``llama-bpe``, without its
  ``ignore_merges``).
- ``<name>/<name>-BF16.gguf`` from llama.cpp's ``convert_hf_to_gguf.py`` (``--outtype bf16``), then
  ``<name>/<name>-<TYPE>.gguf`` for each of ``--quants`` (default Q4_0, Q4_K_M, Q8_0) from
  ``llama-quantize``; both from the llama.cpp sources vendored in the ``llama-cpp-python`` sdist that
  ``bench/compare.py`` builds its peers from (its ``build_llama_cpp``), the converter with that tree's
  ``gguf-py`` first on ``PYTHONPATH``, run in a venv over this interpreter's packages that adds the
  ``sentencepiece`` it imports. The BF16 GGUF is deleted once every asked type exists
  (``--keep-bf16`` keeps it).

Usage::

    python bench/sized_models.py                              # the three small shapes, all types
    python bench/sized_models.py --models qwen2.5-0.5b --quants Q4_K_M
    python bench/sized_models.py --models qwen2.5-7b          # 15 GB folder + 4.5-8 GB GGUFs
    python bench/sized_models.py --list                       # what is built, where
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests"))
import compare  # bench/compare.py: the llama.cpp build and the default model's folder

QUANTS = ("Q4_0", "Q4_K_M", "Q8_0")
DEFAULT_MODELS = ("qwen2.5-0.5b", "smollm2-1.7b", "llama-3.2-3b")
SLICE_ELEMENTS = 1 << 26  # random values generated 64 Mi elements (128 MiB of bf16) at a time

#: Llama 3's chat format (header ids around each role, ``<|eot_id|>`` after each turn).
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "attention_dropout": 0.0, "initializer_range": 0.02, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 32768,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16", "use_cache": True,
}
_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
    "rms_norm_eps": 1e-05, "pretraining_tp": 1, "torch_dtype": "bfloat16", "use_cache": True,
}


@dataclass(frozen=True)
class Shape:
    """One real model's shape: its ``config.json`` numbers and where its tokenizer comes from.

    ``tokenizer``: ``qwen2`` or ``llama-bpe`` (zoo folders of ``tests/testdata.py``) or ``smollm2``
    (the default model's folder); ``eos_token``: the instruct model's end-of-turn token.
    """

    source: str
    config: dict[str, Any]
    tokenizer: str
    eos_token: str
    chat_template: str | None = None


SHAPES: dict[str, Shape] = {
    "qwen2.5-0.5b": Shape("Qwen/Qwen2.5-0.5B-Instruct config.json", {
        **_QWEN2, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "max_window_layers": 21,
        "tie_word_embeddings": True, "vocab_size": 151936}, "qwen2", "<|im_end|>"),
    "smollm2-1.7b": Shape("HuggingFaceTB/SmolLM2-1.7B-Instruct config.json", {
        **_LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
        "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 8192,
        "rope_theta": 130000, "rope_scaling": None, "tie_word_embeddings": True, "vocab_size": 49152,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}, "smollm2", "<|im_end|>"),
    "llama-3.2-3b": Shape("meta-llama/Llama-3.2-3B-Instruct config.json", {
        **_LLAMA, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
        "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": True, "vocab_size": 128256, "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009]}, "llama-bpe", "<|eot_id|>", LLAMA3_CHAT_TEMPLATE),
    "qwen2.5-7b": Shape("Qwen/Qwen2.5-7B-Instruct config.json", {
        **_QWEN2, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "max_window_layers": 28,
        "tie_word_embeddings": False, "vocab_size": 152064}, "qwen2", "<|im_end|>"),
}


def log(msg: str) -> None:
    print(f"[sized {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sized_root() -> Path:
    """Where built models live (see the module docstring)."""
    env = os.environ.get("STREAMPROXY_SIZED_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "streamproxy-bench" / "sized-models"


def tensor_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint's tensors in a Llama / Qwen2 ``*ForCausalLM`` layout: ``(name, shape)`` in file order.

    Qwen2 has q/k/v biases; ``lm_head.weight`` only when the embeddings are not tied.
    """
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // heads
    bias = config["model_type"] == "qwen2"
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out += [(f"{p}.input_layernorm.weight", (h,)),
                (f"{p}.self_attn.q_proj.weight", (heads * hd, h)),
                (f"{p}.self_attn.k_proj.weight", (kv * hd, h)),
                (f"{p}.self_attn.v_proj.weight", (kv * hd, h))]
        if bias:
            out += [(f"{p}.self_attn.q_proj.bias", (heads * hd,)), (f"{p}.self_attn.k_proj.bias", (kv * hd,)),
                    (f"{p}.self_attn.v_proj.bias", (kv * hd,))]
        out += [(f"{p}.self_attn.o_proj.weight", (h, heads * hd)),
                (f"{p}.post_attention_layernorm.weight", (h,)),
                (f"{p}.mlp.gate_proj.weight", (inter, h)), (f"{p}.mlp.up_proj.weight", (inter, h)),
                (f"{p}.mlp.down_proj.weight", (h, inter))]
    out.append(("model.norm.weight", (h,)))
    if not config.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (v, h)))
    return out


def _slices(name: str, shape: tuple[int, ...], std: float, seed: int) -> Iterator[bytes]:
    """The bf16 bytes of one tensor, row-slice by row-slice: norms 1, biases 0, weights N(0, std)."""
    n = math.prod(shape)
    if name.endswith(("norm.weight", ".bias")):
        fill = 1.0 if name.endswith("norm.weight") else 0.0
        yield torch.full((n,), fill, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
        return
    gen = torch.Generator().manual_seed(seed)
    for start in range(0, n, SLICE_ELEMENTS):
        count = min(SLICE_ELEMENTS, n - start)
        values = torch.randn(count, generator=gen, dtype=torch.float32).mul_(std).to(torch.bfloat16)
        yield values.view(torch.int16).numpy().tobytes()


def write_random_safetensors(config: dict[str, Any], path: Path, seed: int = 0) -> None:
    """``model.safetensors`` of random bf16 weights for ``config``, written as a stream (the format:
    an 8-byte little-endian header length, a JSON header of dtype / shape / data_offsets, the data).
    Memory holds one slice of :data:`SLICE_ELEMENTS` values at a time."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    tensors = tensor_shapes(config)
    for name, shape in tensors:
        nbytes = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(path.name + ".partial")
    with tmp.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for i, (name, shape) in enumerate(tensors):
            for chunk in _slices(name, shape, config["initializer_range"], seed * 100_003 + i):
                f.write(chunk)
    tmp.rename(path)


def tokenizer_folder(shape: Shape) -> Path:
    """The folder whose tokenizer files the shape takes (see the module docstring)."""
    if shape.tokenizer == "smollm2":
        return compare.hf_folder(Path(os.environ.get("STREAMPROXY_PEERS_SCRATCH", "/tmp/streamproxy-peers")))
    import testdata  # tests/testdata.py: the tokenizer zoo

    return testdata.zoo_path(shape.tokenizer)


def write_small_files(shape: Shape, folder: Path) -> None:
    """The folder's config, generation config, tokenizer and chat template (rewritten on every build:
    they are small). Added tokens whose id is past the config's ``vocab_size`` are dropped (the zoo's
    Llama 3 tokenizer carries an ``<|endoftext|>`` at 128256, one past Llama 3's vocabulary, which
    the converter refuses)."""
    folder.mkdir(parents=True, exist_ok=True)
    src = tokenizer_folder(shape)
    for f in ("tokenizer_config.json", "chat_template.jinja"):
        if (src / f).exists():
            shutil.copyfile(src / f, folder / f)
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = shape.config["vocab_size"]
    tok["added_tokens"] = [t for t in tok.get("added_tokens", []) if t["id"] < vocab]
    (folder / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    tok_cfg["eos_token"] = shape.eos_token
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    if shape.chat_template is not None:
        (folder / "chat_template.jinja").write_text(shape.chat_template)
    cfg = dict(shape.config)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def build_hf(name: str) -> Path:
    """The shape's Hugging Face folder (weights written once, :func:`write_small_files` every time);
    returns it."""
    shape = SHAPES[name]
    folder = sized_root() / name / "hf"
    write_small_files(shape, folder)
    if (folder / "model.safetensors").exists():
        return folder
    cfg = shape.config
    params = sum(math.prod(s) for _, s in tensor_shapes(cfg))
    log(f"{name}: writing {params / 1e9:.2f} B random bf16 weights ({2 * params / 2**30:.1f} GiB) "
        f"to {folder}")
    write_random_safetensors(cfg, folder / "model.safetensors")
    return folder


def converter_python(scratch: Path) -> Path:
    """A venv over the running interpreter's packages (``compare.overlay_venv``: the same torch,
    transformers, numpy) plus ``sentencepiece``, which the converter imports for Qwen2 and Llama
    vocabularies (even BPE ones); returns its python."""
    venv = scratch / "venv-convert"
    logf = scratch / "logs" / "venv-convert.log"
    py = compare.overlay_venv(venv, logf)
    if not compare._imports(py, "sentencepiece"):
        log(f"installing sentencepiece into {venv} (log {logf})")
        compare._run([str(py), "-m", "pip", "install", "-q", "sentencepiece>=0.1.98,<0.3.0"], logf, nice=0)
    return py


def gguf_file(name: str, quant: str) -> Path:
    """Where the shape's GGUF of type ``quant`` (``BF16``, ``Q4_K_M``, ...) is (built or not)."""
    return sized_root() / name / f"{name}-{quant}.gguf"


def build_gguf(name: str, quant: str, scratch: Path) -> Path:
    """The shape's GGUF of type ``quant`` (built once, with the BF16 GGUF as the quantizer's input).

    Raises:
        compare.PeerUnavailable: when llama.cpp cannot be built or a tool fails (its log is named).
    """
    out = gguf_file(name, quant)
    if out.exists():
        return out
    logs = scratch / "logs"
    bf16 = gguf_file(name, "BF16")
    if not bf16.exists():
        hf = build_hf(name)
        tree = compare.llama_sources(scratch) / "vendor" / "llama.cpp"
        path = os.pathsep.join([str(tree / "gguf-py"), os.environ.get("PYTHONPATH", "")])
        env = dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        log(f"{name}: convert_hf_to_gguf.py -> {bf16.name} (log {logs / 'convert-hf-to-gguf.log'})")
        tmp = bf16.with_name(bf16.name + ".partial")
        compare._run([str(converter_python(scratch)), str(tree / "convert_hf_to_gguf.py"), str(hf),
                      "--outfile", str(tmp), "--outtype", "bf16"],
                     logs / "convert-hf-to-gguf.log", env=env, nice=10, cwd=tree)
        tmp.rename(bf16)
    if quant == "BF16":
        return bf16
    quantize = compare.build_llama_cpp(scratch, "llama-quantize")
    log(f"{name}: llama-quantize {quant} -> {out.name}")
    tmp = out.with_name(out.name + ".partial")
    compare._run([str(quantize), str(bf16), str(tmp), quant, str(os.cpu_count() or 2)],
                 logs / "llama-quantize.log", nice=10)
    tmp.rename(out)
    return out


def build(
    names: list[str], quants: list[str], scratch: Path, keep_bf16: bool = False
) -> dict[str, list[Path]]:
    """Every asked shape's HF folder and GGUFs; returns ``{name: [folder, gguf, ...]}``."""
    built: dict[str, list[Path]] = {}
    for name in names:
        built[name] = [build_hf(name)] + [build_gguf(name, q, scratch) for q in quants]
        bf16 = gguf_file(name, "BF16")
        if not keep_bf16 and "BF16" not in quants and bf16.exists():
            bf16.unlink()
    return built


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="random-weight models of real shapes: HF folders and GGUFs")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--quants", default=",".join(QUANTS), help="comma list of llama-quantize types (or BF16)")
    p.add_argument("--scratch", default="/tmp/streamproxy-peers", help="llama.cpp sources, build, logs")
    p.add_argument("--keep-bf16", action="store_true", help="keep the BF16 GGUF the quantizer read")
    p.add_argument("--list", action="store_true", help="print what is built, build nothing")
    args = p.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        p.error(f"unknown model(s) {unknown}; known: {', '.join(SHAPES)}")
    quants = [q for q in args.quants.split(",") if q]
    if args.list:
        for name in SHAPES:
            for path in [sized_root() / name / "hf", *(gguf_file(name, q) for q in (*QUANTS, "BF16"))]:
                if path.exists():
                    files = list(path.rglob("*")) if path.is_dir() else [path]
                    size = sum(f.stat().st_size for f in files)
                    print(f"{size / 2**30:7.2f} GiB  {path}")
        return 0
    try:
        built = build(names, quants, Path(args.scratch), args.keep_bf16)
    except compare.PeerUnavailable as exc:
        log(f"failed: {exc}")
        return 1
    for name, paths in built.items():
        for path in paths:
            print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
