"""A vision-language model given as llama.cpp ships it (``--mmproj``, issue 49): the text model's GGUF
plus its ``mmproj`` GGUF, the vision tower and projector as llama.cpp's ``convert_hf_to_gguf.py
--mmproj`` writes them (``general.architecture`` ``clip``, ``general.type`` ``mmproj``), turned into
the transformers config and processor of the model's Hugging Face folder; the weights are then read
from the two files (:class:`proxy.models.gguf_weights.PairWeights`).

The mmproj's metadata (``clip.*``, gguf-py's ``Keys.ClipVision``) gives the vision config and the
image processor's settings; its tensors carry gguf-py's ``MMPROJ`` names (``v.blk.0.attn_q``,
``mm.model.fc``), which its ``TensorNameMap`` maps from transformers' own parameter names. The text
config and tokenizer (chat template, image tokens) are the text GGUF's, as for a text model
(``proxy.models.source``). Per projector type (``clip.projector_type``, :data:`PROJECTORS`):

- ``idefics3`` (the converter's ``SmolVLMModel``: ``Idefics3ForConditionalGeneration`` and
  ``SmolVLMForConditionalGeneration``): an ``Idefics3Config`` (the file does not say which of the two
  classes it came from; they compute the same, and SmolVLM's first release, SmolVLM-256M/500M/2B, is
  Idefics3), the vision config from ``clip.vision.{embedding_length, feed_forward_length, block_count,
  attention.head_count, image_size, patch_size, attention.layer_norm_epsilon}``, ``scale_factor``
  from ``clip.vision.projector.scale_factor``; the converter copies the tensors unchanged (no
  permutation: ``SmolVLMModel`` has no ``modify_tensors``). Its processor: ``Idefics3Processor`` over
  the text GGUF's tokenizer, images resized to a longest edge of ``clip.vision.preproc_image_size``
  (the processor's ``size``) and split into tiles of ``image_size`` (``max_image_size``), normalised
  by ``clip.vision.image_mean`` / ``image_std``, ``image_seq_len`` = (image_size / patch_size)^2 /
  scale_factor^2; the settings the file does not hold are the class's defaults (LANCZOS, rescale
  1/255, splitting and padding on: those of SmolVLM's published ``processor_config.json``). The text
  GGUF must be a ``llama`` one whose tokenizer has ``<image>``.
- ``pixtral`` (the converter's ``LlavaVisionModel`` for ``LlavaForConditionalGeneration`` with a
  Pixtral tower, Pixtral-12B's layout): a ``LlavaConfig`` with a ``PixtralVisionConfig`` from the same
  ``clip.vision.*`` keys and ``hidden_act`` from ``clip.use_silu`` / ``clip.use_gelu``; what the file
  does not hold is Pixtral-12B's published config (``vision_feature_layer`` -1, the ``full``
  strategy, a ``gelu`` projector, RoPE theta 10000, the RMSNorm eps 1e-5 transformers hard-codes,
  checked against ``layer_norm_epsilon``). The converter permutes the tower's q/k rows as for llama
  (``LlamaModel.permute``), undone by transformers' ``LlamaTensorProcessor`` over the vision heads,
  and writes the tower under the checkpoint's names (``vision_tower.``, not ``model.vision_tower.``).
  Its processor: ``PixtralProcessor`` (``[IMG]``, ``[IMG_BREAK]``, ``[IMG_END]`` from the tokenizer),
  images resized to a longest edge of ``image_size`` in ``patch_size`` patches, no merge. An mmproj
  with ``clip.vision.spatial_merge_size`` (Mistral3's patch merger) is refused; Mistral3's text GGUF
  (``mistral3``) is not one transformers reads either.

Refused at load, naming the file and the reason (:class:`~proxy.models.loaded.ModelLoadError`): a file
that is not an mmproj GGUF, an audio-only one, a projector type not in :data:`PROJECTORS`, a text GGUF
of another architecture, a projection width other than the text model's hidden size, a tokenizer
without the image token, a setting the projector needs missing from the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from proxy.models.loaded import ModelLoadError

MMPROJ_MIN_BLOCKS = 8
"""The fewest blocks an mmproj's name map covers: gguf-py numbers a projector's layers by block as
well (``multi_modal_projector.linear_{bid}`` -> ``mm.{bid}``), so a tower of fewer blocks than its
projector's last index would leave that layer unmapped."""


@dataclass(frozen=True)
class Mmproj:
    """An mmproj GGUF's metadata: ``path``, ``projector`` (``clip.projector_type``), ``values`` (every
    ``clip.*`` key -> its value: a scalar, a string or a list)."""

    path: Path
    projector: str
    values: dict[str, Any]

    def get(self, key: str) -> Any:
        """``clip.<key>``'s value.

        Raises:
            ModelLoadError: the file lacks it (named with the file).
        """
        if f"clip.{key}" not in self.values:
            raise ModelLoadError(f"--mmproj {self.path.name}: clip.{key} is missing (the {self.projector!r} "
                                 "projector needs it)")
        return self.values[f"clip.{key}"]


def _value(field: Any) -> Any:
    value = field.contents()
    if isinstance(value, np.generic):
        value = value.item()
    return value


def read_mmproj(path: Path) -> Mmproj:
    """The metadata of the mmproj GGUF ``path`` (gguf-py's ``GGUFReader``; an mmproj has no vocabulary,
    so every field is read).

    Raises:
        ModelLoadError: not a file, not a GGUF, not an mmproj (``general.architecture`` other than
            ``clip``), no vision encoder, or no ``clip.projector_type``.
    """
    from gguf import GGUFReader

    if not path.is_file():
        raise ModelLoadError(f"--mmproj {str(path)!r}: no such file")
    try:
        fields = GGUFReader(str(path)).fields
    except Exception as exc:  # noqa: BLE001 (gguf-py raises ValueError, struct.error, OSError, ...)
        raise ModelLoadError(f"--mmproj {path.name}: not a GGUF file ({type(exc).__name__}: {exc})") from None
    values = {k: _value(f) for k, f in fields.items() if k.startswith(("general.", "clip."))}
    arch = values.get("general.architecture")
    if arch != "clip":
        raise ModelLoadError(f"--mmproj {path.name}: not an mmproj file (general.architecture {arch!r}; "
                             "convert_hf_to_gguf.py --mmproj writes 'clip'); it goes with --model")
    if not values.get("clip.has_vision_encoder", False):
        raise ModelLoadError(f"--mmproj {path.name}: has no vision encoder (an audio encoder only?); "
                             "streamproxy serves images")
    projector = values.get("clip.projector_type", values.get("clip.vision.projector_type"))
    if not isinstance(projector, str):
        raise ModelLoadError(f"--mmproj {path.name}: clip.projector_type is missing")
    if projector not in PROJECTORS:
        why = f": {REASONS[projector]}" if projector in REASONS else ""
        raise ModelLoadError(f"--mmproj {path.name}: projector type {projector!r} is not served yet{why} "
                             f"(served: {', '.join(sorted(PROJECTORS))})")
    return Mmproj(path, projector, values)


def _f32(value: Any) -> float:
    """A float32 the converter wrote as the shortest decimal that reads back to it (``1e-06`` for the
    float32 nearest 1e-6, as the config held it)."""
    return float(str(np.float32(value)))


def _token_id(tokenizer: Any, token: str, mmproj: Mmproj, text: Path) -> int:
    token_id = tokenizer.get_vocab().get(token)
    if token_id is None:
        raise ModelLoadError(f"--mmproj {mmproj.path.name} ({mmproj.projector}) needs the image token "
                             f"{token!r}, which {text.name}'s tokenizer lacks: not this mmproj's text model")
    return int(token_id)


def _idefics3(text_config: Any, tokenizer: Any, mmproj: Mmproj, text: Path) -> tuple[Any, Any]:
    """``(Idefics3Config, Idefics3Processor)`` (module docstring)."""
    from transformers import Idefics3Config, Idefics3Processor, Idefics3VisionConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    image_size, patch_size = int(mmproj.get("vision.image_size")), int(mmproj.get("vision.patch_size"))
    scale = int(mmproj.get("vision.projector.scale_factor"))
    vision = Idefics3VisionConfig(
        hidden_size=int(mmproj.get("vision.embedding_length")),
        intermediate_size=int(mmproj.get("vision.feed_forward_length")),
        num_hidden_layers=int(mmproj.get("vision.block_count")),
        num_attention_heads=int(mmproj.get("vision.attention.head_count")),
        image_size=image_size, patch_size=patch_size,
        layer_norm_eps=_f32(mmproj.get("vision.attention.layer_norm_epsilon")))
    config = Idefics3Config(vision_config=vision.to_dict(), text_config=text_config.to_dict(),
                            scale_factor=scale, image_token_id=_token_id(tokenizer, "<image>", mmproj, text),
                            tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)))
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": int(mmproj.get("vision.preproc_image_size"))},
        max_image_size={"longest_edge": image_size},
        image_mean=[_f32(v) for v in mmproj.get("vision.image_mean")],
        image_std=[_f32(v) for v in mmproj.get("vision.image_std")])
    seq_len = (image_size // patch_size) ** 2 // scale**2
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=seq_len,
                                  chat_template=getattr(tokenizer, "chat_template", None))
    return config, processor


def _pixtral(text_config: Any, tokenizer: Any, mmproj: Mmproj, text: Path) -> tuple[Any, Any]:
    """``(LlavaConfig, PixtralProcessor)`` of a LLaVA with a Pixtral tower (module docstring)."""
    from transformers import LlavaConfig, PixtralVisionConfig
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    from proxy.media.processor_classes import pixtral_processor_class

    if "clip.vision.spatial_merge_size" in mmproj.values:
        raise ModelLoadError(f"--mmproj {mmproj.path.name}: a Pixtral tower with a patch merger (Mistral3) "
                             "is not served from GGUF yet")
    if _f32(mmproj.get("vision.attention.layer_norm_epsilon")) != 1e-5:
        raise ModelLoadError(f"--mmproj {mmproj.path.name}: layer_norm_epsilon is not 1e-5, the value "
                             "transformers' Pixtral tower computes with")
    values = mmproj.values
    act = "silu" if values.get("clip.use_silu") else "gelu" if values.get("clip.use_gelu") else None
    if act is None:
        raise ModelLoadError(f"--mmproj {mmproj.path.name}: clip.use_gelu / clip.use_silu is missing")
    image_size, patch_size = int(mmproj.get("vision.image_size")), int(mmproj.get("vision.patch_size"))
    vision = PixtralVisionConfig(
        hidden_size=int(mmproj.get("vision.embedding_length")),
        intermediate_size=int(mmproj.get("vision.feed_forward_length")),
        num_hidden_layers=int(mmproj.get("vision.block_count")),
        num_attention_heads=int(mmproj.get("vision.attention.head_count")),
        image_size=image_size, patch_size=patch_size, hidden_act=act)
    config = LlavaConfig(vision_config=vision.to_dict(), text_config=text_config.to_dict(),
                         image_token_index=_token_id(tokenizer, "[IMG]", mmproj, text),
                         projector_hidden_act="gelu", vision_feature_layer=-1,
                         vision_feature_select_strategy="full",
                         tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)))
    for token in ("[IMG_BREAK]", "[IMG_END]"):
        _token_id(tokenizer, token, mmproj, text)
    images = PixtralImageProcessorPil(
        size={"longest_edge": image_size}, patch_size={"height": patch_size, "width": patch_size},
        image_mean=[_f32(v) for v in mmproj.get("vision.image_mean")],
        image_std=[_f32(v) for v in mmproj.get("vision.image_std")])
    processor = pixtral_processor_class()(image_processor=images, tokenizer=tokenizer, patch_size=patch_size,
                                          spatial_merge_size=1,
                                          chat_template=getattr(tokenizer, "chat_template", None))
    return config, processor


def _llama_rows(mmproj: Mmproj) -> Any:
    """transformers' ``LlamaTensorProcessor`` over the vision heads: it undoes ``LlamaModel.permute``,
    which ``LlavaVisionModel`` applies to the Pixtral tower's q/k rows."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    heads = int(mmproj.get("vision.attention.head_count"))
    return LlamaTensorProcessor(config={"num_attention_heads": heads, "num_key_value_heads": heads})


@dataclass(frozen=True)
class Projector:
    """How one projector type is served: the text GGUF architectures it goes with, the parameter
    prefixes of its vision tower and projector (read from the mmproj), the builder of its
    ``(config, processor)`` from the text config, the tokenizer, the mmproj and the text GGUF's path,
    and of the mmproj's row order (None: rows as stored)."""

    text_archs: tuple[str, ...]
    vision_modules: tuple[str, ...]
    build: Any
    rows: Any = None


PROJECTORS: dict[str, Projector] = {
    "idefics3": Projector(("llama",), ("model.vision_model.", "model.connector."), _idefics3),
    "pixtral": Projector(("llama",), ("model.vision_tower.", "model.multi_modal_projector."), _pixtral,
                         _llama_rows),
}
"""``clip.projector_type`` -> how it is served (module docstring)."""


def vlm_parts(text_config: Any, tokenizer: Any, mmproj: Mmproj, text: Path,
              text_arch: str) -> tuple[Any, Any]:
    """The vision-language config (``architectures`` set) and processor of the text GGUF ``text``
    (its transformers config ``text_config``, architecture ``text_arch``, tokenizer) with ``mmproj``.

    Raises:
        ModelLoadError: the text GGUF's architecture or hidden size is not the mmproj's text model's,
            its tokenizer lacks the image token, or a setting is missing (each naming the files).
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    spec = PROJECTORS[mmproj.projector]
    if text_arch not in spec.text_archs:
        raise ModelLoadError(f"--mmproj {mmproj.path.name} ({mmproj.projector}) goes with a text model of "
                             f"architecture {', '.join(spec.text_archs)}; {text.name} is {text_arch!r}")
    width, hidden = int(mmproj.get("vision.projection_dim")), int(text_config.hidden_size)
    if width != hidden:
        raise ModelLoadError(f"--mmproj {mmproj.path.name} projects images to {width} features; "
                             f"{text.name}'s hidden size is {hidden}: not the text model of this mmproj")
    config, processor = spec.build(text_config, tokenizer, mmproj, text)
    config.architectures = [MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[config.model_type]]
    return config, processor


_QWEN = ("its text GGUF's architecture (qwen2vl) is not one transformers' GGUF loader reads, nor are "
         "its M-RoPE sections")
REASONS: dict[str, str] = {
    "gemma3": ("Gemma 3's image tokens attend to each other bidirectionally, which the paged causal "
               "attention does not compute (its images are refused from a Hugging Face folder too)"),
    "qwen2vl_merger": _QWEN,
    "qwen2.5vl_merger": _QWEN,
    "qwen3vl_merger": "Qwen3-VL adds vision features to its first decoder layers (DeepStack), not served",
}
"""Projector types of VLM families streamproxy serves from Hugging Face folders, refused from an mmproj
for a reason of their own (``docs/mmproj.md``)."""


def row_processor(mmproj: Mmproj) -> Any:
    """The ``TensorProcessor`` that orders the mmproj's rows (:attr:`Projector.rows`), or None."""
    spec = PROJECTORS[mmproj.projector]
    return None if spec.rows is None else spec.rows(mmproj)
