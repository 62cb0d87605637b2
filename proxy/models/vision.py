"""Vision-language models: which are served with their images (:data:`SERVED`, in
``proxy.media.processor`` with their processor, the API side), how they load, and their vision encoder
(the engine side).

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
  column marker tokens (``Idefics3Model.inputs_merger``);
- Qwen2-VL and Qwen2.5-VL (``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``):
  an image resized to a multiple of the patch size times the merge size becomes ``t * h * w / merge**2``
  placeholders, and the decoder takes 3-D rotary positions (M-RoPE, :data:`MROPE`): the prompt's from
  the model's own ``get_rope_index`` (:func:`mrope_positions`), every later token's its position plus
  the prompt's rope delta (``proxy.engine.execution.mrope``);
- LLaVA-OneVision (``LlavaOnevisionForConditionalGeneration``): one image, LLaVA-Next's packing with
  ``anyres_max_N`` (features of more than N base views' worth shrunk by bilinear interpolation,
  ``pack_image_features``); several in a prompt, a base view and a newline each (its multi-image
  mode, ``VisionProcessor.nested``);
- SmolVLM (``SmolVLMForConditionalGeneration``): Idefics3's tiles and markers;
- Mistral3 (``Mistral3ForConditionalGeneration``, Mistral Small 3.x) and LLaVA with a Pixtral vision
  tower (Pixtral-12B): transformers' Pixtral tower (2-D RoPE over each image's own patch grid; the
  encoder takes ``pixel_values`` and ``image_sizes``), Mistral3's patch merger; each image is one
  ``[IMG]`` placeholder per (merged) patch, rows ended by ``[IMG_BREAK]`` and the image by
  ``[IMG_END]``, which are text tokens (``PixtralProcessor.replace_image_token``).

LLaVA-OneVision's, SmolVLM's, Qwen2-VL's and Qwen2.5-VL's processors are loaded without their video
part and Pixtral's without torchvision (``proxy.media.processor_classes``; videos are not accepted);
SmolVLM's needs ``num2words``.

Refused at load by name (:func:`refusal`): Qwen3-VL (:data:`REASONS`) and the other image-text-to-text
model types that transformers' causal-LM classes do not load. Those its causal-LM classes load are
served as text models and refuse images per request with :func:`images_refusal`'s reason (Gemma 3:
image tokens attend bidirectionally within an image, which the paged causal attention does not compute).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from proxy.media.processor import NEEDS_PACKAGE, SERVED, VisionProcessor, images_refusal, is_served_vision
from proxy.media.prompt import PromptImages

MROPE: frozenset[str] = frozenset({"qwen2_vl", "qwen2_5_vl"})
"""Types in :data:`SERVED` whose decoder takes 3-D M-RoPE positions (temporal, height, width)."""

_DEEPSTACK = ("adds vision features to the hidden states of its first decoder layers (DeepStack), which "
              "streamproxy's paged decoder does not do yet")
REASONS: dict[str, str] = {"qwen3_vl": _DEEPSTACK, "qwen3_vl_moe": _DEEPSTACK}
"""Vision-language types refused for a reason of their own (the reason names what is unsupported)."""


def refusal(config: Any) -> str | None:
    """Why a vision-language config cannot be served (to be refused at load), or None: a type in
    :data:`SERVED` (unless a package its processor needs, ``NEEDS_PACKAGE``, is missing), a text
    model, or an image-text-to-text type transformers' causal-LM classes load (served as a text
    model; its images are refused per request, :func:`images_refusal`). :data:`REASONS` names its own."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    model_type = str(getattr(config, "model_type", ""))
    package = NEEDS_PACKAGE.get(model_type)
    if package is not None and importlib.util.find_spec(package) is None:
        return (f"is served with its images, but its processor needs the package '{package}', which is not "
                f"installed (pip install {package}; streamproxy's own install has it)")
    if (model_type in SERVED or model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
            or model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        return None
    served = ", ".join(sorted(SERVED))
    if model_type in REASONS:
        return f"is a vision-language model that {REASONS[model_type]} (served with images: {served})"
    return f"is a vision-language model that streamproxy does not serve yet (served with images: {served})"


def decoder_attention(config: Any, attn: str) -> str | dict[str, str]:
    """The ``attn_implementation`` that puts ``attn`` on the decoder of ``config`` only: a model in
    :data:`SERVED` keeps its vision tower on SDPA (the paged attention serves the decoder's cache; the
    vision tower attends within one image), any other model takes ``attn`` whole."""
    return {"text_config": attn, "vision_config": "sdpa"} if is_served_vision(config) else attn


def load_model_class(config: Any) -> Any:
    """The transformers class that loads a :data:`SERVED` config."""
    import transformers

    return getattr(transformers, SERVED[str(config.model_type)])


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


def encoder_linears(model: Any) -> frozenset[str]:
    """Qualified names of a served vision-language model's linear layers outside its text decoder
    (``get_decoder()``) and output layer: the vision tower's and the projector's. ``--quantization
    int4`` / ``int8`` leaves them dense (``proxy.models.quantize``): the packed kernels serve the
    decoder's few-row decode calls, while an image's patches are many rows a call, which the dense
    bf16 / fp32 matmul serves, and the encoder's outputs stay those of the model's own weights."""
    decoder = {id(m) for m in model.get_decoder().modules()}
    head = model.get_output_embeddings()
    return frozenset(name for name, module in model.named_modules()
                     if isinstance(module, torch.nn.Linear) and id(module) not in decoder
                     and module is not head)


def uses_mrope(config: Any) -> bool:
    """True for a config of a type in :data:`MROPE`."""
    return str(getattr(config, "model_type", "")) in MROPE


def mrope_positions(model: Any, prompt_ids: list[int], images: PromptImages) -> tuple[torch.Tensor, int]:
    """The M-RoPE positions of a prompt with images for a :data:`MROPE` model: ``([3, L] int64 on the
    CPU, rope delta)``, from the model's own ``get_rope_index`` (``Qwen2VLModel.get_rope_index``: text
    tokens count on in all three rows; an image's placeholders take (temporal, row, column) from
    its ``image_grid_thw`` over the spatial merge, after which text goes on from the image's largest
    position + 1) with the placeholder tokens as its image tokens (``mm_token_type_ids`` 1, the rest 0,
    as the processor marks them). The delta is ``max(positions) + 1 - L``: a token at position
    ``p >= L`` takes ``p + delta`` in all three rows (``compute_3d_position_ids``)."""
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    types = torch.zeros_like(ids, dtype=torch.int)
    types[0, list(images.token_positions)] = 1
    positions, deltas = model.model.get_rope_index(ids, mm_token_type_ids=types,
                                                   image_grid_thw=images.encoder_inputs["image_grid_thw"])
    return positions[:, 0].to("cpu", torch.long).contiguous(), int(deltas.reshape(-1)[0])


__all__ = ["MROPE", "SERVED", "VisionProcessor", "decoder_attention", "encode_images", "encoder_linears",
           "images_refusal", "is_served_vision", "load_model_class", "mrope_positions", "refusal",
           "uses_mrope"]
