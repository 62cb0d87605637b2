"""The processor of a vision-language model served with its images (the API side): the rendered chat's
image placeholders expanded into the model's placeholder tokens and the images turned into the vision
encoder's inputs, by transformers' ``AutoProcessor`` with the Pillow image backend (``backend="pil"``:
torchvision is not installed here, and the two backends resize differently, so a reference must use the
same one). Which model types are served with their images, and how their encoders run:
``proxy.models.vision``.

Torch-free at import (transformers is imported when a processor is loaded): the API process imports it
before any model is.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from proxy.errors import InvalidRequestError

from .decode import LoadedImage
from .pieces import split
from .prompt import PromptImages

SERVED: dict[str, str] = {
    "llava": "LlavaForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
    "llava_onevision": "LlavaOnevisionForConditionalGeneration",
    "smolvlm": "SmolVLMForConditionalGeneration",
    "mistral3": "Mistral3ForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
}
"""Model types served with their images -> the transformers class that runs them."""

OWN_CLASS = frozenset({"llava_onevision", "smolvlm", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe",
                       "pixtral"})
"""Processors ``AutoProcessor`` cannot build without torchvision, by :func:`processor_kind`: built as
their class by ``proxy.media.processor_classes`` (LLaVA-OneVision's, SmolVLM's, Qwen2-VL's,
Qwen2.5-VL's and Qwen3-VL's without their video processor; Pixtral's)."""

NESTED = frozenset({"llava_onevision"})
"""Types whose processor reads a prompt's images as one nested list (:class:`VisionProcessor`'s
``nested``)."""

NEEDS_PACKAGE: dict[str, str] = {"smolvlm": "num2words"}
"""Served types whose processor needs a package beyond transformers (transformers checks for it when
the processor is built)."""

IMAGES_REFUSED: dict[str, str] = {}
"""Image-text-to-text types served as text models -> why their images are refused (per request)."""


def images_refusal(config: Any) -> str | None:
    """Why the images of a model served as a text model are refused, for a request's 400: an
    image-text-to-text type that transformers' causal-LM classes load (:data:`IMAGES_REFUSED`'s
    reason, else "its vision tower is not run"); None for a type in :data:`SERVED` and for text
    models."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    model_type = str(getattr(config, "model_type", ""))
    if model_type in SERVED or model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return None
    return IMAGES_REFUSED.get(model_type, "is served as a text model: its vision tower is not run")


def processor_kind(config: Any) -> str:
    """``pixtral`` for a model with a Pixtral vision tower (Mistral3; LLaVA as Pixtral-12B is
    published), else its model type."""
    vision = getattr(config, "vision_config", None)
    if str(getattr(vision, "model_type", "")) == "pixtral":
        return "pixtral"
    return str(getattr(config, "model_type", ""))


def is_served_vision(config: Any) -> bool:
    """True for a config of a model type in :data:`SERVED`."""
    return str(getattr(config, "model_type", "")) in SERVED


class VisionProcessor:
    """The served model's processor, for prompts with images.

    Args:
        processor: the transformers processor (``tokenizer``, ``image_processor``, ``image_token``).
        image_token_id: the placeholder token of one image patch (``config.image_token_id``).
        nested: the prompt's images go to the processor as one list per prompt (``[[a, b]]``), as
            ``apply_chat_template`` passes a conversation's images; LLaVA-OneVision then takes its
            multi-image mode (a prompt with several images: each one base view and a newline, no
            anyres grid), a flat list being read as one image per prompt. False: a flat list.
        model_type: the model's type, which says how its encoder's work is cut into pieces
            (``proxy.media.pieces``; "": one piece of the prompt's images).
    """

    def __init__(self, processor: Any, image_token_id: int, nested: bool = False,
                 model_type: str = "") -> None:
        self.processor = processor
        self.image_token_id = image_token_id
        self.nested = nested
        self.model_type = model_type

    @classmethod
    def load(cls, folder: str | Path, config: Any = None) -> VisionProcessor | None:
        """``AutoProcessor.from_pretrained(folder, backend="pil")`` of a :data:`SERVED` model's folder
        (a processor of :data:`OWN_CLASS`: its class, ``proxy.media.processor_classes``); None for
        any other model (``config``: its ``AutoConfig``, read from ``folder`` when None)."""
        from transformers import AutoConfig, AutoProcessor

        config = config if config is not None else AutoConfig.from_pretrained(str(folder))
        if not is_served_vision(config):
            return None
        if processor_kind(config) in OWN_CLASS:
            from .processor_classes import load_processor

            processor = load_processor(str(folder), processor_kind(config))
        else:
            processor = AutoProcessor.from_pretrained(str(folder), backend="pil")
        model_type = str(config.model_type)
        return cls(processor, int(config.image_token_id), nested=model_type in NESTED, model_type=model_type)

    def num_tokens(self, images: Sequence[LoadedImage]) -> list[int]:
        """Placeholder tokens of each image (the processor's ``_get_num_multimodal_tokens``, the
        count vLLM's transformers backend reads too; for several images :attr:`nested` into
        LLaVA-OneVision's multi-image mode, which that count does not know, its
        ``replace_image_token``'s: ``num_image_tokens`` + 1 newline, less the CLS feature under the
        ``default`` strategy)."""
        if self.nested and len(images) > 1:
            per_image = int(self.processor.num_image_tokens) + 1
            per_image -= self.processor.vision_feature_select_strategy == "default"
            return [per_image] * len(images)
        sizes = [[im.size[1], im.size[0]] for im in images]
        return [int(n) for n in self.processor._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens]

    def prompt(self, text: str, images: Sequence[LoadedImage]) -> tuple[list[int], PromptImages]:
        """The token ids of the rendered chat ``text`` with each image placeholder expanded, and the
        prompt's :class:`PromptImages` (placeholder positions, content hashes, ``pixel_values``, the
        encoder's pieces: ``proxy.media.pieces``). CPU work (resize, normalise): callers run it off
        the event loop.

        Raises:
            InvalidRequestError: the text's placeholders do not match the images (a message that
                writes the placeholder token itself), naming the first image.
        """
        param = images[0].param
        try:
            pictures = [im.image for im in images]
            enc = self.processor(text=[text], images=[pictures] if self.nested else pictures,
                                 return_tensors="pt", add_special_tokens=False)
            ids = [int(t) for t in enc.pop("input_ids")[0].tolist()]
            enc.pop("attention_mask", None)
            for types in ("mm_token_type_ids", "token_type_ids"):  # Qwen2-VL's, Gemma 3's: the
                enc.pop(types, None)  # placeholder positions say it (PromptImages)
            counts, hashes, inputs = self.num_tokens(images), [im.content_hash for im in images], dict(enc)
            pieces = split(self.model_type, counts, hashes, inputs,
                           int(getattr(self.processor, "image_seq_len", 0) or 0))
            return ids, PromptImages.of(ids, self.image_token_id, counts, hashes, inputs, pieces)
        except ValueError as exc:
            raise InvalidRequestError(
                f"'{param}': the prompt's image placeholders do not match its {len(images)} image(s) (does "
                f"a message write the placeholder {getattr(self.processor, 'image_token', '')!r} itself?): "
                f"{exc}", param=param) from None
