"""A random-weight vision-language model of a real shape, built offline: its Hugging Face folder, its
text GGUF and its ``mmproj`` GGUF (llama.cpp's layout), for ``bench/compare.py --image-size``.

The shape is HuggingFaceTB/SmolVLM-256M-Instruct's ``config.json`` (Idefics3: a SigLIP base-patch16-512
vision tower of 12 layers, pixel shuffle by 4 and a linear connector, on SmolLM2-135M's decoder of 30
layers; numbers in :data:`TEXT`, :data:`VISION`), an architecture streamproxy serves with its images and
llama.cpp's ``convert_hf_to_gguf.py --mmproj`` converts. Speed does not depend on the weights' values
(a benchmark generates with ``ignore_eos``), as for ``bench/sized_models.py``'s text shapes.

What is built under ``$STREAMPROXY_SIZED_DIR`` (``bench/sized_models.py``'s ``sized_root``), in
``smolvlm-256m/``, each file written under a temporary name and renamed once complete:

- ``hf/``: ``Idefics3ForConditionalGeneration`` of the shape, transformers' random init, saved in bf16;
  the tokenizer of SmolLM2 (the default model's converted folder, ``compare.hf_folder``) with SmolVLM's
  added tokens in its order (``<global-img>``, the 36 ``<row_r_col_c>``, ``<fake_token_around_image>``,
  ``<image>`` at 49190, as the real config's ``image_token_id``; then ``<end_of_utterance>``, the end of
  a turn); the real model's image processor settings (images resized to a longest edge of 2048, split
  into 512 x 512 tiles plus a global view, 64 placeholders a tile) and a chat template in its format
  (``User: ...<end_of_utterance>`` / ``Assistant:``), with string contents too;
- ``smolvlm-256m-BF16.gguf`` (``convert_hf_to_gguf.py --outtype bf16``) and
  ``mmproj-smolvlm-256m-F16.gguf`` (``--mmproj --outtype f16``), from the llama.cpp sources vendored in
  the llama-cpp-python sdist, as ``bench/sized_models.py`` converts.

Usage::

    python bench/sized_vlm.py            # prints the three paths; then, V being their folder:
    python bench/compare.py --peers streamproxy,llama-server --image-size 512 \\
        --model $V/hf --gguf-model $V/smolvlm-256m-BF16.gguf   # streamproxy: the folder; llama-server: GGUFs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import compare  # bench/compare.py: the llama.cpp sources and the default model's folder
import sized_models  # bench/sized_models.py: where models live, the converter's venv

NAME = "smolvlm-256m"
SOURCE = "HuggingFaceTB/SmolVLM-256M-Instruct config.json"
TEXT = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "max_position_embeddings": 8192, "rms_norm_eps": 1e-05,
        "rope_theta": 100000, "vocab_size": 49280, "tie_word_embeddings": False}
VISION = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
          "image_size": 512, "patch_size": 16, "layer_norm_eps": 1e-06}
SCALE_FACTOR = 4
IMAGE_SEQ_LEN = 64  # (512 / 16)^2 patches / 4^2
IMAGE_TOKEN_ID = 49190
ADDED_TOKENS = ["<global-img>", *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
                "<fake_token_around_image>", "<image>", "<end_of_utterance>"]
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def log(msg: str) -> None:
    print(f"[sized-vlm {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def folder() -> Path:
    return sized_models.sized_root() / NAME


def processor(scratch: Path) -> Any:
    """SmolLM2's tokenizer with SmolVLM's added tokens, and the real image processor's settings.

    Raises:
        RuntimeError: ``<image>`` is not id 49190 (SmolLM2's vocabulary is not the 49,152 tokens expected).
    """
    from transformers import AutoTokenizer, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tok = AutoTokenizer.from_pretrained(str(compare.hf_folder(scratch)))
    tok.add_special_tokens({"additional_special_tokens": ADDED_TOKENS})
    if tok.convert_tokens_to_ids("<image>") != IMAGE_TOKEN_ID:
        raise RuntimeError(f"<image> is {tok.convert_tokens_to_ids('<image>')}, not {IMAGE_TOKEN_ID}")
    tok.eos_token = "<end_of_utterance>"
    images = Idefics3ImageProcessorPil(
        do_resize=True, size={"longest_edge": 4 * VISION["image_size"]},
        max_image_size={"longest_edge": VISION["image_size"]}, do_image_splitting=True, resample=1,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    return Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=IMAGE_SEQ_LEN,
                             chat_template=CHAT_TEMPLATE)


def build_hf(scratch: Path) -> Path:
    """The Hugging Face folder (weights once; the small files every time); returns it."""
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3VisionConfig,
        LlamaConfig,
    )

    hf = folder() / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    proc = processor(scratch)
    proc.save_pretrained(str(hf))
    eos = proc.tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    text = LlamaConfig(**TEXT, bos_token_id=1, eos_token_id=eos, pad_token_id=2)
    vision = Idefics3VisionConfig(**VISION)
    config = Idefics3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                            scale_factor=SCALE_FACTOR, image_token_id=IMAGE_TOKEN_ID,
                            tie_word_embeddings=False)
    if not (hf / "model.safetensors").exists():
        log(f"{NAME}: random weights of {SOURCE} -> {hf}")
        torch.manual_seed(0)
        model = Idefics3ForConditionalGeneration(config).to(torch.bfloat16)
        tmp = hf.with_name("hf.partial")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(str(tmp))
        (tmp / "model.safetensors").rename(hf / "model.safetensors")
        shutil.rmtree(tmp)
    config.save_pretrained(str(hf))
    cfg = json.loads((hf / "config.json").read_text())
    cfg["architectures"] = ["Idefics3ForConditionalGeneration"]
    cfg["text_config"]["architectures"] = ["VLlama3ForCausalLM"]  # the converter's text model, as the real
    (hf / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": 1, "eos_token_id": eos, "pad_token_id": 2}
    (hf / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return hf


def build_ggufs(scratch: Path) -> tuple[Path, Path]:
    """The text GGUF (BF16) and the mmproj GGUF (F16), converted once each.

    Raises:
        compare.PeerUnavailable: the converter failed (its log is named).
    """
    text, mmproj = folder() / f"{NAME}-BF16.gguf", folder() / f"mmproj-{NAME}-F16.gguf"
    hf = build_hf(scratch)
    tree = compare.llama_sources(scratch) / "vendor" / "llama.cpp"
    path = os.pathsep.join([str(tree / "gguf-py"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    logf = scratch / "logs" / "convert-vlm.log"
    for out, extra in ((text, ["--outtype", "bf16"]), (mmproj, ["--mmproj", "--outtype", "f16"])):
        if out.exists():
            continue
        log(f"{NAME}: convert_hf_to_gguf.py {' '.join(extra)} -> {out.name} (log {logf})")
        tmp = out.with_name(out.name + ".partial")
        python = sized_models.converter_python(scratch)
        compare._run([str(python), str(tree / "convert_hf_to_gguf.py"), str(hf), "--outfile", str(tmp),
                      *extra], logf, env=env, nice=10, cwd=tree)
        tmp.rename(out)
    return text, mmproj


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=f"{NAME}: a random-weight VLM of a real shape, HF folder + GGUFs")
    p.add_argument("--scratch", default="/tmp/streamproxy-peers", help="llama.cpp sources, logs")
    args = p.parse_args(argv)
    try:
        text, mmproj = build_ggufs(Path(args.scratch))
    except compare.PeerUnavailable as exc:
        log(f"failed: {exc}")
        return 1
    print(f"{folder() / 'hf'}\n{text}\n{mmproj}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
