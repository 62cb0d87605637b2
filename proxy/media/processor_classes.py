"""transformers' processors that ``AutoProcessor`` cannot build here, torchvision being absent (no CPU
wheel for this torch; never a CUDA one), each built as the same class with the same files.

- Processors that also hold a video processor (LLaVA-OneVision, SmolVLM, Qwen2-VL, Qwen2.5-VL,
  Qwen3-VL):
  transformers' video processors need torchvision; ``AutoProcessor`` fails on them
  (``VIDEO_PROCESSOR_MAPPING`` is a stand-in without torchvision), and so does constructing the
  processor with one (its class check reads that mapping). Each ``*ImagesProcessor`` here is its
  family's processor with the same constructor minus ``video_processor``, so ``from_pretrained`` of a
  model folder reads the same ``processor_config.json`` and builds the image processor and tokenizer as
  ``AutoProcessor`` would; text and images are processed by the parent class unchanged
  (``replace_image_token``, ``_get_num_multimodal_tokens``). Videos are not accepted by the API (a
  ``video_url`` part is a 400 naming its type).
- ``PixtralProcessor`` (Pixtral, Mistral3): its module imports one function,
  ``get_resize_output_image_size``, from the torchvision image processor's module, which imports
  torchvision; the Pillow image processor's module defines the same function (transformers' copy,
  "Adapted from" that one, same body), so :func:`pixtral_processor_class` imports it with the Pillow
  module standing in for the torchvision one during that import only.

Imports transformers at import: ``proxy.media.processor`` imports this module when it loads one.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from transformers import (
    LlavaOnevisionProcessor,
    ProcessorMixin,
    Qwen2_5_VLProcessor,
    Qwen2VLProcessor,
    Qwen3VLProcessor,
    SmolVLMProcessor,
)


class LlavaOnevisionImagesProcessor(LlavaOnevisionProcessor):
    """``LlavaOnevisionProcessor`` without its video processor (its arguments, its saved name)."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None,
                 num_image_tokens: int | None = None, vision_feature_select_strategy: str | None = None,
                 chat_template: str | None = None, image_token: str = "<image>", video_token: str = "<video>",
                 vision_aspect_ratio: str = "anyres_max_9", **kwargs: Any) -> None:
        super().__init__(  # type: ignore[no-untyped-call]
            image_processor, tokenizer, None, num_image_tokens=num_image_tokens,
            vision_feature_select_strategy=vision_feature_select_strategy, chat_template=chat_template,
            image_token=image_token, video_token=video_token, vision_aspect_ratio=vision_aspect_ratio,
            **kwargs)


LlavaOnevisionImagesProcessor.__name__ = "LlavaOnevisionProcessor"  # saved as transformers' class
LlavaOnevisionImagesProcessor.__qualname__ = "LlavaOnevisionProcessor"


class SmolVLMImagesProcessor(SmolVLMProcessor):
    """``SmolVLMProcessor`` without its video processor (its arguments, its saved name).

    Raises:
        ImportError: ``num2words`` is not installed (transformers' check; a dependency of this
            project, ``pyproject.toml``).
    """

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, image_seq_len: int = 169,
                 chat_template: str | None = None, **kwargs: Any) -> None:
        super().__init__(image_processor, tokenizer, None, image_seq_len=image_seq_len,
                         chat_template=chat_template, **kwargs)


SmolVLMImagesProcessor.__name__ = SmolVLMImagesProcessor.__qualname__ = "SmolVLMProcessor"  # as above



class Qwen2VLImagesProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` without its video processor (its arguments, its saved name)."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(  # type: ignore[no-untyped-call]
            image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


Qwen2VLImagesProcessor.__name__ = Qwen2VLImagesProcessor.__qualname__ = "Qwen2VLProcessor"  # as above


class Qwen2_5_VLImagesProcessor(Qwen2_5_VLProcessor):
    """``Qwen2_5_VLProcessor`` without its video processor (its arguments, its saved name)."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(  # type: ignore[no-untyped-call]
            image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


Qwen2_5_VLImagesProcessor.__name__ = Qwen2_5_VLImagesProcessor.__qualname__ = "Qwen2_5_VLProcessor"


class Qwen3VLImagesProcessor(Qwen3VLProcessor):
    """``Qwen3VLProcessor`` (Qwen3-VL's and Qwen3-VL-MoE's) without its video processor (its arguments,
    its saved name)."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(  # type: ignore[no-untyped-call]
            image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


Qwen3VLImagesProcessor.__name__ = Qwen3VLImagesProcessor.__qualname__ = "Qwen3VLProcessor"

TORCHVISION_MODULE = "transformers.models.pixtral.image_processing_pixtral"
PILLOW_MODULE = "transformers.models.pixtral.image_processing_pil_pixtral"


def pixtral_processor_class() -> type[ProcessorMixin]:
    """transformers' ``PixtralProcessor`` class, imported with :data:`PILLOW_MODULE` standing in for
    :data:`TORCHVISION_MODULE` (module docstring) when that one cannot be imported; ``sys.modules``
    is left as it was."""
    try:
        from transformers.models.pixtral.processing_pixtral import PixtralProcessor
    except ImportError:
        saved = sys.modules.get(TORCHVISION_MODULE)
        sys.modules[TORCHVISION_MODULE] = importlib.import_module(PILLOW_MODULE)
        try:
            from transformers.models.pixtral.processing_pixtral import PixtralProcessor
        finally:
            if saved is None:
                del sys.modules[TORCHVISION_MODULE]
            else:
                sys.modules[TORCHVISION_MODULE] = saved
    cls: type[ProcessorMixin] = PixtralProcessor
    return cls


def processor_class(kind: str) -> type[ProcessorMixin]:
    """The processor class of a ``kind`` in ``proxy.media.processor.OWN_CLASS``: ``llava_onevision``,
    ``smolvlm``, ``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``, ``qwen3_vl_moe`` (images only) or
    ``pixtral``."""
    if kind == "pixtral":
        return pixtral_processor_class()
    return {"llava_onevision": LlavaOnevisionImagesProcessor, "smolvlm": SmolVLMImagesProcessor,
            "qwen2_vl": Qwen2VLImagesProcessor, "qwen2_5_vl": Qwen2_5_VLImagesProcessor,
            "qwen3_vl": Qwen3VLImagesProcessor, "qwen3_vl_moe": Qwen3VLImagesProcessor}[kind]


def load_processor(folder: str, kind: str) -> Any:
    """``processor_class(kind).from_pretrained(folder, backend="pil")`` (the Pillow image backend, as
    ``proxy.media.processor`` loads every processor)."""
    return processor_class(kind).from_pretrained(folder, backend="pil")
