"""The processor of a vision-language model served with its images (the API side): the rendered chat's
image placeholders expanded into the model's placeholder tokens and the images turned into the vision
encoder's inputs, by transformers' ``AutoProcessor`` with the Pillow image backend (``backend="pil"``:
torchvision is not installed here, and the two backends resize differently, so a reference must use the
same one). Qwen2-VL's and Qwen2.5-VL's processors also hold a video processor, which needs torchvision:
theirs is built from the folder's image processor (Pillow) and tokenizer, without video
(:func:`image_only_processor`). Which model types are served with their images, and how their encoders
run: ``proxy.models.vision``.

Torch-free at import (transformers is imported when a processor is loaded): the API process imports it
before any model is.
"""

from __future__ import annotations

import functools
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
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}
"""Model types served with their images -> the transformers class that runs them."""

IMAGE_ONLY: dict[str, str] = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}
"""Model types whose processor is built without its video part (:func:`image_only_processor`) -> the
transformers processor class."""


def image_only_processor(class_name: str, image_processor: Any, tokenizer: Any,
                         chat_template: str | None = None) -> Any:
    """The transformers processor ``class_name`` (one of :data:`IMAGE_ONLY`'s) over ``image_processor``
    and ``tokenizer`` only, as :func:`_without_video`'s subclass: its video processor would need
    torchvision (``AutoProcessor`` fails without it)."""
    return _without_video(class_name)(image_processor=image_processor, tokenizer=tokenizer,
                                      chat_template=chat_template)


@functools.cache
def _without_video(class_name: str) -> type:
    """A subclass of the transformers processor ``class_name`` whose ``__init__`` names no video
    processor, so transformers' ``ProcessorMixin`` (which takes a processor's parts from its
    ``__init__`` signature) holds none and never processes videos; the class's own ``__init__`` (its
    image token and ids) and everything it does with images are kept."""
    import transformers

    base = getattr(transformers, class_name)

    def __init__(self: Any, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                 **kwargs: Any) -> None:
        # the class's __init__ passes (image_processor, tokenizer, None) on: ProcessorMixin pairs them
        # with this signature's two parts, so the missing video processor is dropped
        base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return type(f"{class_name}WithoutVideo", (base,), {"__init__": __init__, "__module__": __name__})


def load_processor(folder: str | Path, model_type: str) -> Any:
    """The processor of a :data:`SERVED` model's folder, with the Pillow image backend: for an
    :data:`IMAGE_ONLY` type its image processor (``AutoImageProcessor``) and tokenizer
    (``AutoTokenizer``) in :func:`image_only_processor`, else ``AutoProcessor``."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    if model_type not in IMAGE_ONLY:
        return AutoProcessor.from_pretrained(str(folder), backend="pil")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    images = AutoImageProcessor.from_pretrained(str(folder), backend="pil")
    return image_only_processor(IMAGE_ONLY[model_type], images, tokenizer,
                                getattr(tokenizer, "chat_template", None))


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
        """The processor of a :data:`SERVED` model's folder (:func:`load_processor`); None for any other
        model (``config``: its ``AutoConfig``, read from ``folder`` when None)."""
        from transformers import AutoConfig

        config = config if config is not None else AutoConfig.from_pretrained(str(folder))
        if not is_served_vision(config):
            return None
        return cls(load_processor(folder, str(config.model_type)), int(config.image_token_id))

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
            enc.pop("mm_token_type_ids", None)  # Qwen2-VL's: the placeholder positions say it (PromptImages)
            return ids, PromptImages.of(ids, self.image_token_id, self.num_tokens(images),
                                        [im.content_hash for im in images], dict(enc))
        except ValueError as exc:
            raise InvalidRequestError(
                f"'{param}': the prompt's image placeholders do not match its {len(images)} image(s) (does "
                f"a message write the placeholder {getattr(self.processor, 'image_token', '')!r} itself?): "
                f"{exc}", param=param) from None
