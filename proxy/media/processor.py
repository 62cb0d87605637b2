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
from .prompt import PromptImages

SERVED: dict[str, str] = {
    "llava": "LlavaForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
}
"""Model types served with their images -> the transformers class that runs them."""


def is_served_vision(config: Any) -> bool:
    """True for a config of a model type in :data:`SERVED`."""
    return str(getattr(config, "model_type", "")) in SERVED


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
