"""A tiny vision-language model written as llama.cpp ships it: the text GGUF and the mmproj GGUF that
``convert_hf_to_gguf.py`` (and ``--mmproj``) write for its Hugging Face folder, in the converter's
layout, with gguf-py's ``GGUFWriter`` (tests never run the converter):

- text (``LlamaModel``, the converter's class for ``VLlama3ForCausalLM`` / Idefics3's decoder):
  ``general.architecture`` ``llama`` with its ``llama.*`` hyper-parameters, the decoder's weights with
  ``text_model.`` dropped from their names (``filter_tensors``) under gguf-py's ``LLAMA`` names, the
  q/k rows permuted by ``LlamaModel.permute``; the byte-level BPE vocabulary as ``_set_vocab_gpt2``
  writes it (tokens by id, special ones ``CONTROL``, merges, BOS/EOS ids, chat template);
- mmproj (``SmolVLMModel``): ``clip`` / ``mmproj`` with the ``clip.*`` keys its
  ``set_gguf_parameters`` writes, the vision tower and connector under gguf-py's ``MMPROJ`` names,
  as stored (no permutation), 2-D weights in F16 except the ``.embeddings.`` ones (F32, its
  ``tensor_force_quant``), 1-D tensors in F32;
- a LLaVA with a Pixtral tower: its decoder's names lose ``language_model.``; the mmproj
  (``LlavaVisionModel``) has projector type ``pixtral``, ``layer_norm_epsilon`` 1e-5 and
  ``use_gelu`` / ``use_silu``, the checkpoint's names (no ``model.``) and the tower's q/k rows
  permuted by ``LlamaModel.permute``.

The model's vision weights are first rounded to F16 (:func:`round_vision_to_f16`), so that the folder
and the pair hold the same values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

VISION_MODULES = ("model.vision_model.", "model.connector.",
                  "model.vision_tower.", "model.multi_modal_projector.")
"""Idefics3's and LLaVA's vision towers and projectors (what the mmproj holds)."""


def llama_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """``LlamaModel.permute`` of ``convert_hf_to_gguf.py`` (``conversion/llama.py``)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def round_vision_to_f16(model: Any) -> Any:
    """The vision tower's and connector's 2-D weights (but the ``.embeddings.`` ones) rounded to F16
    values, in place: what an F16 mmproj holds."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith(VISION_MODULES) and param.dim() >= 2 and ".embeddings." not in name:
                param.copy_(param.half().float())
    return model


def _write(writer: Any) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _merges(tokenizer: Any) -> list[str]:
    import json

    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def write_text_gguf(model: Any, tokenizer: Any, path: Path, linears: Any = None) -> Path:
    """The text GGUF of an ``Idefics3ForConditionalGeneration`` (module docstring), F32 weights;
    ``linears``: a ``GGMLQuantizationType`` the decoder's 2-D weights but the embedding are written in."""
    import gguf
    from gguf.quants import quantize

    text = model.config.text_config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(text.num_hidden_layers)
    writer.add_context_length(text.max_position_embeddings)
    writer.add_embedding_length(text.hidden_size)
    writer.add_feed_forward_length(text.intermediate_size)
    writer.add_head_count(text.num_attention_heads)
    writer.add_head_count_kv(text.num_key_value_heads)
    writer.add_rope_freq_base(float(text.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(text.rms_norm_eps)
    writer.add_vocab_size(text.vocab_size)
    writer.add_rope_dimension_count(text.hidden_size // text.num_attention_heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    added = tokenizer.added_tokens_decoder  # get_vocab_base: special ones CONTROL (3), others USER_DEFINED
    ids = range(len(tokenizer))
    writer.add_token_list([tokenizer.convert_ids_to_tokens(i) for i in ids])
    writer.add_token_types([(3 if added[i].special else 4) if i in added else 1 for i in ids])
    writer.add_token_merges(_merges(tokenizer))
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_chat_template(tokenizer.chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, text.num_hidden_layers)
    for name, param in model.named_parameters():
        if name.startswith(VISION_MODULES):
            continue
        hf_name = name.replace("text_model.", "").replace("language_model.", "")  # the filter_tensors
        w = param.detach().float().numpy()
        if hf_name.endswith("q_proj.weight"):
            w = llama_permute(w, text.num_attention_heads, text.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            w = llama_permute(w, text.num_attention_heads, text.num_key_value_heads)
        gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if linears is not None and w.ndim == 2 and gname != "token_embd.weight":
            writer.add_tensor(gname, quantize(w, linears), raw_dtype=linears)
        else:
            writer.add_tensor(gname, np.ascontiguousarray(w))
    _write(writer)
    return path


def write_mmproj(model: Any, processor: Any, path: Path, **overrides: Any) -> Path:
    """The mmproj GGUF of an ``Idefics3ForConditionalGeneration`` or a LLaVA with a Pixtral tower and
    its processor (module docstring); ``overrides``: ``clip.*`` values written instead
    (``projector_type``, ``projection_dim``)."""
    import gguf

    config, vision = model.config, model.config.vision_config
    images = processor.image_processor
    pixtral = vision.model_type == "pixtral"
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(overrides.get("projection_dim", config.text_config.hidden_size))
    writer.add_vision_image_size(vision.image_size)
    writer.add_vision_patch_size(vision.patch_size)
    writer.add_vision_embedding_length(vision.hidden_size)
    writer.add_vision_feed_forward_length(vision.intermediate_size)
    writer.add_vision_block_count(vision.num_hidden_layers)
    writer.add_vision_head_count(vision.num_attention_heads)
    writer.add_vision_image_mean(list(images.image_mean))
    writer.add_vision_image_std(list(images.image_std))
    writer.add_clip_projector_type(overrides.get("projector_type", "pixtral" if pixtral else "idefics3"))
    if pixtral:  # LlavaVisionModel.set_gguf_parameters
        writer.add_vision_attention_layernorm_eps(1e-5)
        (writer.add_vision_use_silu if vision.hidden_act == "silu" else writer.add_vision_use_gelu)(True)
    else:  # SmolVLMModel.set_gguf_parameters
        writer.add_vision_attention_layernorm_eps(vision.layer_norm_eps)
        writer.add_vision_projector_scale_factor(config.scale_factor)
        writer.add_vision_use_gelu(True)
        writer.add_vision_preproc_image_size(images.size["longest_edge"])
    # a map of 8 blocks at least: mm.{bid} (LLaVA's linear_2) is numbered as a block (MMPROJ_MIN_BLOCKS)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(vision.num_hidden_layers, 8))
    for name, param in model.named_parameters():
        if not name.startswith(VISION_MODULES):
            continue
        w = param.detach().float().numpy()
        if pixtral and name.endswith(("q_proj.weight", "k_proj.weight")):  # LlavaVisionModel.modify_tensors
            w = llama_permute(w, vision.num_attention_heads, vision.num_attention_heads)
        f16 = w.ndim >= 2 and ".embeddings." not in name
        hf_name = name.removeprefix("model.") if pixtral else name  # the checkpoint's names
        writer.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")),
                          w.astype(np.float16) if f16 else np.ascontiguousarray(w))
    _write(writer)
    return path


def make_gguf_pair(folder: Path, out: Path) -> tuple[Path, Path]:
    """The text GGUF and mmproj of the Hugging Face folder ``folder`` (a tiny Idefics3 or LLaVA with a
    Pixtral tower whose vision weights are F16 values), written into ``out``: ``(text, mmproj)``."""
    from transformers import AutoModelForImageTextToText

    from proxy.media.processor import VisionProcessor

    model = AutoModelForImageTextToText.from_pretrained(str(folder))
    vision = VisionProcessor.load(folder)
    assert vision is not None
    out.mkdir(parents=True, exist_ok=True)
    text = write_text_gguf(model, vision.processor.tokenizer, out / f"{folder.name}-F32.gguf")
    return text, write_mmproj(model, vision.processor, out / f"mmproj-{folder.name}-F16.gguf")
