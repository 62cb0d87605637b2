"""What loading a model produces (:class:`LoadedModel`, the engine's input) and the one error it
raises when it cannot (:class:`ModelLoadError`, a startup error, not an API error)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from proxy.media.processor import VisionProcessor


class ModelLoadError(RuntimeError):
    """The model cannot be found, converted or served (a startup error, not an API error)."""


@dataclass
class LoadedModel:
    """A model ready for the engine.

    Attributes:
        model: the causal LM, eval mode, on ``device``, using the paged attention implementation.
        hf_tokenizer: its transformers tokenizer.
        model_path: the Hugging Face folder it was loaded from.
        served_model_name: the id clients send as ``model``.
        max_model_len: context length in tokens.
        eos_token_ids: ids that end a sequence.
        device: ``torch.device`` of the weights.
        dtype: ``torch.dtype`` of the weights.
        quantization: what the linears are served as (:func:`proxy.models.quantize.apply_quantization`'s
            description, e.g. ``"gguf: Q4_1 -> int4 g32 x210, Q8_0 -> int8 g32 x1, ..."``; ``"none"``: dense).
        gguf_path: the ``.gguf`` file the folder was converted from (its tensors may be the served
            weights), or None.
        vision: the processor of a vision-language model served with its images
            (``proxy.models.vision``); None: a text model.
    """

    model: Any
    hf_tokenizer: Any
    model_path: str
    served_model_name: str
    max_model_len: int
    eos_token_ids: frozenset[int]
    device: torch.device
    dtype: torch.dtype
    quantization: str = "none"
    gguf_path: str | None = None
    vision: VisionProcessor | None = None
