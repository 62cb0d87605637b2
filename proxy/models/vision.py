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
  ``[IMG_END]``, which are text tokens (``PixtralProcessor.replace_image_token``);
- Qwen3-VL (``Qwen3VLForConditionalGeneration``; ``Qwen3VLMoeForConditionalGeneration``, its MoE
  decoder): Qwen2.5-VL's placeholders and M-RoPE positions (its rotary embedding interleaves the three
  rows' frequencies, inside the model), and DeepStack (:data:`DEEPSTACK`): the vision tower also gives
  ``N`` more embeddings per placeholder (one per ``deepstack_visual_indexes`` entry), the ``i``-th added
  to the placeholder positions' hidden states after decoder layer ``i`` (``Qwen3VLTextModel.forward``,
  ``_deepstack_process``), done here by per-step forward hooks (``proxy.engine.execution.deepstack``).
- Gemma 3 (``Gemma3ForConditionalGeneration``): a SigLIP tower whose patches are average-pooled to
  ``mm_tokens_per_image`` soft tokens between ``<start_of_image>`` and ``<end_of_image>`` (no
  pan-and-scan crops: ``Gemma3Processor`` makes them only when a call asks, ``do_pan_and_scan``,
  and its ``_get_num_multimodal_tokens`` does not count them); during prefill an image's
  tokens attend to each other both ways (:data:`BIDIRECTIONAL_IMAGES`,
  ``proxy.engine.execution.image_blocks``), its sliding-window layers within their window.

The vision encoder runs on one piece of a prompt's images at a time (:func:`encode_piece`): a view of
Idefics3 / SmolVLM, an image of LLaVA, LLaVA-Next, Pixtral and Qwen2-VL / Qwen2.5-VL, the prompt's
images together for the others (``proxy.media.pieces``).

LLaVA-OneVision's, SmolVLM's and the Qwen VL processors are loaded without their video part and
Pixtral's without torchvision (``proxy.media.processor_classes``; videos are not accepted); SmolVLM's
needs ``num2words``.

Refused at load by name (:func:`refusal`): the image-text-to-text model types that transformers'
causal-LM classes do not load (:data:`REASONS` where one has a reason of its own). Those its causal-LM
classes load are served as text models and refuse images per request with :func:`images_refusal`'s
reason.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from proxy.media.processor import NEEDS_PACKAGE, SERVED, VisionProcessor, images_refusal, is_served_vision
from proxy.media.prompt import EncoderPiece, PromptImages

MROPE: frozenset[str] = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})
"""Types in :data:`SERVED` whose decoder takes 3-D M-RoPE positions (temporal, height, width)."""

DEEPSTACK: frozenset[str] = frozenset({"qwen3_vl", "qwen3_vl_moe"})
"""Types in :data:`SERVED` whose vision tower also gives DeepStack embeddings (module docstring)."""

BIDIRECTIONAL_IMAGES: frozenset[str] = frozenset({"gemma3"})
"""Types in :data:`SERVED` whose image tokens attend to every token of their image during prefill
(``proxy.engine.execution.image_blocks``)."""

REASONS: dict[str, str] = {}
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


def encode_piece(model: Any, piece: EncoderPiece, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The embeddings of one piece of a prompt's images (``proxy.media.pieces``), one row per
    placeholder token it fills, in prompt order: ``[piece.rows, hidden]`` in ``dtype`` on ``device``,
    from the model's vision encoder and projector (``get_image_features(...).pooler_output``,
    concatenated as the model's forward does); for a :data:`DEEPSTACK` model
    ``[piece.rows, 1 + N, hidden]``: the input embedding, then the ``N`` DeepStack embeddings of
    decoder layers ``0 .. N-1`` (``deepstack_features``, each concatenated as ``Qwen3VLModel.forward``
    does).

    Raises:
        ValueError: the encoder gave another number of rows than the piece fills.
    """
    inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in piece.inputs.items()}
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    with torch.inference_mode():
        out = model.get_image_features(**inputs, return_dict=True)
        rows = torch.cat(list(out.pooler_output), dim=0).to(device, dtype)
        if str(model.config.model_type) in DEEPSTACK:
            layers = [torch.cat(list(feature), dim=0).to(device, dtype) for feature in out.deepstack_features]
            rows = torch.stack([rows, *layers], dim=1)
    if rows.shape[0] != piece.rows:
        raise ValueError(f"the vision encoder gave {rows.shape[0]} rows for {piece.rows} image "
                         "placeholder tokens")
    return rows


def image_row_shape(model: Any) -> tuple[int, ...]:
    """The shape of one placeholder's row of :func:`encode_piece`: ``(hidden,)``, or ``(1 + N, hidden)``
    for a :data:`DEEPSTACK` model with ``N`` ``vision_config.deepstack_visual_indexes``."""
    hidden = int(model.get_input_embeddings().weight.shape[1])
    if str(model.config.model_type) not in DEEPSTACK:
        return (hidden,)
    return (1 + len(model.config.vision_config.deepstack_visual_indexes), hidden)


def deepstack_layers(model: Any) -> list[torch.nn.Module]:
    """The decoder layers of a :data:`DEEPSTACK` model that take DeepStack embeddings, first to last
    (``model.language_model.layers``, as many as ``vision_config.deepstack_visual_indexes``); empty
    for any other model."""
    if str(model.config.model_type) not in DEEPSTACK:
        return []
    count = len(model.config.vision_config.deepstack_visual_indexes)
    return list(model.model.language_model.layers[:count])


def bidirectional_images(config: Any) -> bool:
    """True for a config of a type in :data:`BIDIRECTIONAL_IMAGES`."""
    return str(getattr(config, "model_type", "")) in BIDIRECTIONAL_IMAGES


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
    CPU, rope delta)``, from the model's own ``get_rope_index`` (``Qwen2VLModel.get_rope_index``, the
    same for images in ``Qwen3VLModel.get_rope_index``, whose difference is videos' timestamps: text
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


__all__ = ["BIDIRECTIONAL_IMAGES", "DEEPSTACK", "MROPE", "SERVED", "VisionProcessor", "bidirectional_images",
           "decoder_attention", "deepstack_layers", "encode_piece", "encoder_linears", "image_row_shape",
           "images_refusal", "is_served_vision", "load_model_class", "mrope_positions", "refusal",
           "uses_mrope"]
