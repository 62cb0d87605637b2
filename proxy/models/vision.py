"""Vision-language models: which are served with their images, their processor (the API side), and
their vision encoder (the engine side).

Served with images (:data:`SERVED`), decoders with 1-D positions whose forward places the projected
image features, in order, on the embeddings of the image placeholder tokens (``masked_scatter``), so a
prompt with images runs as ``inputs_embeds`` through the same paged decoder:

- LLaVA (``LlavaForConditionalGeneration``: a CLIP-style vision tower and a projector): each image
  becomes ``image_seq_length`` placeholder tokens (``LlavaModel.forward``);
- LLaVA-Next (``LlavaNextForConditionalGeneration``): an image is cut to the best of its grid pinpoints
  plus a base view, its features packed with a newline embedding per row (``pack_image_features``),
  one placeholder per packed feature;
- Idefics3 (``Idefics3ForConditionalGeneration``, the architecture of SmolVLM's first release): each
  image is split into tiles plus a global view, each ``image_seq_len`` placeholders between row /
  column marker tokens (``Idefics3Model.inputs_merger``).
 Other image-text-to-text model types that
transformers' causal-LM classes do not load are refused at load by name
(:func:`refusal`); those its causal-LM classes load (Gemma 3, Llama 4, ...) are served as text models
and refuse images per request.

The processor: transformers' ``AutoProcessor`` with the Pillow image backend (``backend="pil"``), as
torchvision is not installed here and the two backends resize differently (a reference must use the
same one); the chat is rendered by the tokenizer's template as for text models, then the processor
expands the image placeholders and computes ``pixel_values`` (:meth:`VisionProcessor.prompt`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from proxy.errors import InvalidRequestError
from proxy.media.decode import LoadedImage
from proxy.media.prompt import PromptImages

SERVED: dict[str, str] = {
    "llava": "LlavaForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
}
"""Model types served with their images -> the transformers class that runs them."""


def is_served_vision(config: Any) -> bool:
    """True for a config of a model type in :data:`SERVED`."""
    return str(getattr(config, "model_type", "")) in SERVED


def refusal(config: Any) -> str | None:
    """Why a vision-language config cannot be served (to be refused at load), or None: a type in
    :data:`SERVED`, a text model, or an image-text-to-text type transformers' causal-LM classes load
    (served as a text model; its images are refused per request)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    model_type = str(getattr(config, "model_type", ""))
    if (model_type in SERVED or model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
            or model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        return None
    return (f"is a vision-language model that streamproxy does not serve yet (served with images: "
            f"{', '.join(sorted(SERVED))})")


def decoder_attention(config: Any, attn: str) -> str | dict[str, str]:
    """The ``attn_implementation`` that puts ``attn`` on the decoder of ``config`` only: a model in
    :data:`SERVED` keeps its vision tower on SDPA (the paged attention serves the decoder's cache; the
    vision tower attends within one image), any other model takes ``attn`` whole."""
    return {"text_config": attn, "vision_config": "sdpa"} if is_served_vision(config) else attn


def load_model_class(config: Any) -> Any:
    """The transformers class that loads a :data:`SERVED` config."""
    import transformers

    return getattr(transformers, SERVED[str(config.model_type)])


class VisionProcessor:
    """The served model's processor, for prompts with images.

    Args:
        processor: the transformers processor (``tokenizer``, ``image_processor``, ``image_token``).
        image_token_id: the placeholder token of one image patch (``config.image_token_id``).
    """

    def __init__(self, processor: Any, image_token_id: int) -> None:
        self.processor = processor
        self.image_token_id = image_token_id

    @classmethod
    def load(cls, folder: str | Path, config: Any = None) -> VisionProcessor | None:
        """``AutoProcessor.from_pretrained(folder, backend="pil")`` of a :data:`SERVED` model's folder;
        None for any other model (``config``: its ``AutoConfig``, read from ``folder`` when None)."""
        from transformers import AutoConfig, AutoProcessor

        config = config if config is not None else AutoConfig.from_pretrained(str(folder))
        if not is_served_vision(config):
            return None
        processor = AutoProcessor.from_pretrained(str(folder), backend="pil")
        return cls(processor, int(config.image_token_id))

    def num_tokens(self, images: Sequence[LoadedImage]) -> list[int]:
        """Placeholder tokens of each image (the processor's ``_get_num_multimodal_tokens``, the
        count vLLM's transformers backend reads too)."""
        sizes = [[im.size[1], im.size[0]] for im in images]
        return [int(n) for n in self.processor._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens]

    def prompt(self, text: str, images: Sequence[LoadedImage]) -> tuple[list[int], PromptImages]:
        """The token ids of the rendered chat ``text`` with each image placeholder expanded, and the
        prompt's :class:`PromptImages` (placeholder positions, content hashes, ``pixel_values``).
        CPU work (resize, normalise): callers run it off the event loop.

        Raises:
            InvalidRequestError: the text's placeholders do not match the images (a message that
                writes the placeholder token itself), naming the first image.
        """
        param = images[0].param
        try:
            enc = self.processor(text=[text], images=[im.image for im in images], return_tensors="pt",
                                 add_special_tokens=False)
            ids = [int(t) for t in enc.pop("input_ids")[0].tolist()]
            enc.pop("attention_mask", None)
            return ids, PromptImages.of(ids, self.image_token_id, self.num_tokens(images),
                                        [im.content_hash for im in images], dict(enc))
        except ValueError as exc:
            raise InvalidRequestError(
                f"'{param}': the prompt's image placeholders do not match its {len(images)} image(s) (does "
                f"a message write the placeholder {getattr(self.processor, 'image_token', '')!r} itself?): "
                f"{exc}", param=param) from None


def encode_images(model: Any, images: PromptImages, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The embeddings of a prompt's images, one row per placeholder token in prompt order:
    ``[sum(images.counts), hidden]`` in ``dtype`` on ``device``, from the model's vision encoder and
    projector (``get_image_features(...).pooler_output``, concatenated as the model's forward does).

    Raises:
        ValueError: the encoder gave another number of rows than the prompt has placeholders.
    """
    inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v)
              for k, v in images.encoder_inputs.items()}
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    with torch.inference_mode():
        out = model.get_image_features(**inputs, return_dict=True).pooler_output
        rows = torch.cat(list(out), dim=0).to(device, dtype)
    if rows.shape[0] != len(images.token_positions):
        raise ValueError(f"the vision encoder gave {rows.shape[0]} rows for {len(images.token_positions)} "
                         "image placeholder tokens")
    return rows
