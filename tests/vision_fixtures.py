"""Tiny random vision-language models and their processors, built from configs (no hub downloads),
each over the API tests' BPE tokenizer with its image tokens added and a ChatML template that renders
``<image>`` per image part; the processors use Pillow, as the server does.

- LLaVA: a 2-layer Llama + a 2-layer CLIP vision tower on 32 x 32 images in 8 x 8 patches + the
  projector: 16 placeholder tokens per image (4 x 4 patches, the CLS feature dropped by the
  ``default`` strategy).
- Idefics3: the same Llama + a 2-layer Idefics3 vision tower on 32 x 32 tiles, pixel-shuffled by 2:
  4 placeholders per tile; an image is resized to a longest edge of 64 and split into tiles plus a
  global view (a 40 x 30 image: 4 tiles + 1, 20 placeholders).
- Qwen2-VL and Qwen2.5-VL: a 2-layer Qwen2-VL decoder with M-RoPE (``mrope_section`` [2, 3, 3]) + a
  2-layer vision tower on 4 x 4 patches merged 2 x 2 (Qwen2.5-VL's in windows of 2 x 2 merged patches,
  its second block full): an image is resized to multiples of 8 (a 40 x 30 image: 40 x 32, a grid of
  8 x 10 patches, 20 placeholders between ``<|vision_start|>`` and ``<|vision_end|>``); the processor
  is built without video (``proxy.media.processor_classes``), as the server builds it.
- Qwen3-VL and Qwen3-VL-MoE: a 3-layer Qwen3-VL decoder (MoE: 4 experts) + a 2-layer vision tower on
  Qwen2-VL's patches and placeholders, with DeepStack embeddings for the first 2 decoder layers.
- LLaVA-OneVision: a 2-layer Qwen2 + a 2-layer SigLIP tower on 32 x 32 views in 8 x 8 patches, the
  grid pinpoints :data:`ONEVISION_PINPOINTS` and ``anyres_max_1`` (a 40 x 30 image: 16 base + 15
  packed placeholders; a 70 x 50 one has its packed features shrunk by interpolation); its processor
  without the video part (``proxy.media.processor_classes``), as the server loads it.
- SmolVLM: Idefics3's shapes as ``SmolVLMForConditionalGeneration`` with ``SmolVLMProcessor`` (images
  only; it needs ``num2words``).
- Mistral3 and LLaVA with a Pixtral tower (Pixtral-12B's layout): a 2-layer Mistral + a 2-layer Pixtral
  tower on 8 x 8 patches of images resized to a longest edge of 64 (Mistral3: 2 x 2 patches merged
  into one placeholder), ``PixtralProcessor`` with ``[IMG]`` / ``[IMG_BREAK]`` / ``[IMG_END]`` (a
  40 x 30 image: 3 x 2 placeholders for Mistral3, 5 x 4 for LLaVA, one break per row but the last).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from proxy.ports import LocalServer, start_serve

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 32
NUM_IMAGE_TOKENS = 16
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML whose list contents render text parts and an ``<image>`` per image part (as LLaVA's do)."""


def _tokenizer_with(tokens: list[str], template: str) -> Any:
    """A copy of the API tests' byte-level BPE tokenizer with ``tokens`` added as special tokens and
    ``template`` as its chat template."""
    from api.fakes import make_hf_tokenizer

    tok = copy.deepcopy(make_hf_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": tokens})
    tok.chat_template = template
    return tok


@functools.lru_cache(maxsize=1)
def llava_tokenizer() -> Any:
    """The API tests' byte-level BPE tokenizer with ``<image>`` added and the vision template."""
    return _tokenizer_with([IMAGE_TOKEN], TEMPLATE)


def llava_processor() -> Any:
    """``LlavaProcessor`` over :func:`llava_tokenizer` and a Pillow CLIP image processor (32 x 32)."""
    from transformers import LlavaProcessor
    from transformers.models.clip import CLIPImageProcessorPil

    images = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                   crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return LlavaProcessor(image_processor=images, tokenizer=llava_tokenizer(), patch_size=8,
                          vision_feature_select_strategy="default", chat_template=TEMPLATE,
                          image_token=IMAGE_TOKEN, num_additional_image_tokens=1)


def build_tiny_llava(seed: int = 0) -> Any:
    """A tiny random ``LlavaForConditionalGeneration`` (fp32, CPU, eval, SDPA attention), weights drawn
    larger than the default init so that logits are far from ties."""
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    tok = llava_tokenizer()
    torch.manual_seed(seed)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                       bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), tie_word_embeddings=False)
    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=8, projection_dim=16)
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN), vision_feature_layer=-2,
                         vision_feature_select_strategy="default")
    return far_from_ties(LlavaForConditionalGeneration(config))


def make_tiny_llava(folder: Path) -> Path:
    """:func:`build_tiny_llava` and :func:`llava_processor` saved as a Hugging Face folder."""
    build_tiny_llava().save_pretrained(folder)
    llava_processor().save_pretrained(folder)
    return folder


IDEFICS3_TOKENS = ["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>"]
IDEFICS3_SEQ_LEN = 4
"""Placeholders per tile: (32 / 8)^2 patches, pixel-shuffled by ``scale_factor`` 2."""


@functools.lru_cache(maxsize=1)
def idefics3_tokenizer() -> Any:
    """The API tests' BPE tokenizer with Idefics3's image tokens added and the vision template."""
    return _tokenizer_with(IDEFICS3_TOKENS, TEMPLATE)


def idefics3_processor() -> Any:
    """``Idefics3Processor`` with a Pillow image processor that resizes to a longest edge of 64 and
    splits into 32 x 32 tiles (plus the global view)."""
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    images = Idefics3ImageProcessorPil(size={"longest_edge": 2 * IMAGE_SIZE},
                                       max_image_size={"longest_edge": IMAGE_SIZE}, do_image_splitting=True)
    return Idefics3Processor(image_processor=images, tokenizer=idefics3_tokenizer(),
                             image_seq_len=IDEFICS3_SEQ_LEN, chat_template=TEMPLATE)


def build_tiny_idefics3(seed: int = 0) -> Any:
    """A tiny random ``Idefics3ForConditionalGeneration`` (fp32, CPU, eval, SDPA), weights as
    :func:`build_tiny_llava`'s."""
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3VisionConfig,
        LlamaConfig,
    )

    tok = idefics3_tokenizer()
    torch.manual_seed(seed)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                       bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), tie_word_embeddings=False)
    vision = Idefics3VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=8)
    config = Idefics3Config(vision_config=vision, text_config=text, scale_factor=2,
                            image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN))
    return far_from_ties(Idefics3ForConditionalGeneration(config))


def smolvlm_processor(longest_edge: int = 2 * IMAGE_SIZE) -> Any:
    """The images-only ``SmolVLMProcessor`` with :func:`idefics3_processor`'s sizes (``longest_edge``:
    what an image is resized to before it is split into 32 x 32 tiles; 128: 4 x 4 tiles + the global
    view)."""
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    from proxy.media.processor_classes import SmolVLMImagesProcessor

    images = SmolVLMImageProcessorPil(size={"longest_edge": longest_edge},
                                      max_image_size={"longest_edge": IMAGE_SIZE}, do_image_splitting=True)
    return SmolVLMImagesProcessor(image_processor=images, tokenizer=idefics3_tokenizer(),
                                  image_seq_len=IDEFICS3_SEQ_LEN, chat_template=TEMPLATE)


def build_tiny_smolvlm(seed: int = 0) -> Any:
    """A tiny random ``SmolVLMForConditionalGeneration``: :func:`build_tiny_idefics3`'s parts."""
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMVisionConfig

    config = build_tiny_idefics3(seed).config
    torch_seed(seed)
    vision = SmolVLMVisionConfig(**{k: getattr(config.vision_config, k) for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
        "patch_size")})
    smol = SmolVLMConfig(vision_config=vision, text_config=config.text_config, scale_factor=2,
                         image_token_id=config.image_token_id)
    return far_from_ties(SmolVLMForConditionalGeneration(smol))


PIXTRAL_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
PIXTRAL_TEMPLATE = TEMPLATE.replace(IMAGE_TOKEN, "[IMG]")
"""The vision template with Pixtral's image token."""


@functools.lru_cache(maxsize=1)
def pixtral_tokenizer() -> Any:
    """The API tests' BPE tokenizer with Pixtral's image tokens added and :data:`PIXTRAL_TEMPLATE`."""
    return _tokenizer_with(PIXTRAL_TOKENS, PIXTRAL_TEMPLATE)


def _pixtral_processor(merge: int) -> Any:
    """``PixtralProcessor`` (imported as the server does) over a Pillow image processor that resizes to
    a longest edge of 64 in 8 x 8 patches, ``merge`` x ``merge`` patches per placeholder."""
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    from proxy.media.processor_classes import pixtral_processor_class

    images = PixtralImageProcessorPil(size={"longest_edge": 2 * IMAGE_SIZE},
                                      patch_size={"height": 8, "width": 8})
    return pixtral_processor_class()(image_processor=images, tokenizer=pixtral_tokenizer(), patch_size=8,
                                     spatial_merge_size=merge, chat_template=PIXTRAL_TEMPLATE)


def _pixtral_parts() -> tuple[Any, Any]:
    """The Mistral decoder and Pixtral tower configs of the Pixtral families."""
    from transformers import MistralConfig, PixtralVisionConfig

    tok = pixtral_tokenizer()
    text = MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=512,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), sliding_window=None,
                         bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), tie_word_embeddings=False)
    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, image_size=2 * IMAGE_SIZE, patch_size=8, head_dim=8)
    return text, vision


def build_tiny_mistral3(seed: int = 0) -> Any:
    """A tiny random ``Mistral3ForConditionalGeneration`` (2 x 2 patch merger), weights as
    :func:`build_tiny_llava`'s."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    torch_seed(seed)
    text, vision = _pixtral_parts()
    config = Mistral3Config(vision_config=vision, text_config=text, spatial_merge_size=2,
                            vision_feature_layer=-1,
                            image_token_id=pixtral_tokenizer().convert_tokens_to_ids("[IMG]"))
    return far_from_ties(Mistral3ForConditionalGeneration(config))


def build_tiny_llava_pixtral(seed: int = 0) -> Any:
    """A tiny random ``LlavaForConditionalGeneration`` with a Pixtral tower (Pixtral-12B's layout)."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    torch_seed(seed)
    text, vision = _pixtral_parts()
    config = LlavaConfig(vision_config=vision, text_config=text, vision_feature_layer=-1,
                         vision_feature_select_strategy="full",
                         image_token_id=pixtral_tokenizer().convert_tokens_to_ids("[IMG]"))
    return far_from_ties(LlavaForConditionalGeneration(config))


GRID_PINPOINTS = [[32, 64], [64, 32], [64, 64]]


def llava_next_processor() -> Any:
    """``LlavaNextProcessor`` with a Pillow image processor over 32 x 32 crops and the grid pinpoints
    :data:`GRID_PINPOINTS`."""
    from transformers import LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    images = LlavaNextImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                        image_grid_pinpoints=GRID_PINPOINTS)
    return LlavaNextProcessor(image_processor=images, tokenizer=llava_tokenizer(), patch_size=8,
                              vision_feature_select_strategy="default", chat_template=TEMPLATE,
                              image_token=IMAGE_TOKEN, num_additional_image_tokens=1)


def build_tiny_llava_next(seed: int = 0) -> Any:
    """A tiny random ``LlavaNextForConditionalGeneration``: :func:`build_tiny_llava`'s parts with the
    grid pinpoints :data:`GRID_PINPOINTS`."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    config = build_tiny_llava(seed).config
    torch_seed(seed)
    next_config = LlavaNextConfig(vision_config=config.vision_config, text_config=config.text_config,
                                  image_token_id=config.image_token_id, image_grid_pinpoints=GRID_PINPOINTS,
                                  vision_feature_layer=-2, vision_feature_select_strategy="default")
    return far_from_ties(LlavaNextForConditionalGeneration(next_config))


ONEVISION_PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64], [96, 96]]


def llava_onevision_processor() -> Any:
    """The images-only ``LlavaOnevisionProcessor`` with a Pillow image processor over 32 x 32 views,
    the pinpoints :data:`ONEVISION_PINPOINTS` and ``anyres_max_1``."""
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    from proxy.media.processor_classes import LlavaOnevisionImagesProcessor

    images = LlavaOnevisionImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                             image_grid_pinpoints=ONEVISION_PINPOINTS)
    return LlavaOnevisionImagesProcessor(image_processor=images, tokenizer=llava_tokenizer(),
                                         num_image_tokens=NUM_IMAGE_TOKENS,
                                         vision_feature_select_strategy="full",
                                         chat_template=TEMPLATE, image_token=IMAGE_TOKEN,
                                         vision_aspect_ratio="anyres_max_1")


def build_tiny_llava_onevision(seed: int = 0) -> Any:
    """A tiny random ``LlavaOnevisionForConditionalGeneration``: a Qwen2 decoder, a SigLIP tower (no
    CLS: the ``full`` strategy, the last layer), weights as :func:`build_tiny_llava`'s."""
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        Qwen2Config,
        SiglipVisionConfig,
    )

    tok = llava_tokenizer()
    torch_seed(seed)
    text = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                       bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), tie_word_embeddings=False)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=8,
                                vision_use_head=False)
    config = LlavaOnevisionConfig(vision_config=vision, text_config=text,
                                  image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN),
                                  image_grid_pinpoints=ONEVISION_PINPOINTS,
                                  vision_aspect_ratio="anyres_max_1",
                                  vision_feature_select_strategy="full", vision_feature_layer=-1)
    return far_from_ties(LlavaOnevisionForConditionalGeneration(config))


def torch_seed(seed: int) -> None:
    import torch

    torch.manual_seed(seed)


def far_from_ties(model: Any) -> Any:
    """Weights drawn larger than the default init (logits far from ties); eval, SDPA."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    model.set_attn_implementation("sdpa")
    return model.eval()


QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_TEMPLATE = TEMPLATE.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")
"""ChatML whose image parts render as Qwen2-VL's template renders them."""


@functools.lru_cache(maxsize=1)
def qwen_tokenizer() -> Any:
    """The API tests' BPE tokenizer with Qwen2-VL's vision tokens added and :data:`QWEN_TEMPLATE`."""
    return _tokenizer_with(QWEN_TOKENS, QWEN_TEMPLATE)


def _qwen_processor(kind: str) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from proxy.media.processor_classes import processor_class

    images = Qwen2VLImageProcessorPil(min_pixels=16 * 16, max_pixels=64 * 64, patch_size=4, merge_size=2,
                                      temporal_patch_size=2)
    return processor_class(kind)(image_processor=images, tokenizer=qwen_tokenizer(),
                                 chat_template=QWEN_TEMPLATE)


def qwen2_vl_processor() -> Any:
    """Qwen2-VL's processor without video over a Pillow image processor (4 x 4 patches, merged 2 x 2)."""
    return _qwen_processor("qwen2_vl")


def qwen2_5_vl_processor() -> Any:
    """Qwen2.5-VL's processor without video, over :func:`qwen2_vl_processor`'s image processor."""
    return _qwen_processor("qwen2_5_vl")


def _qwen_text_config() -> dict[str, Any]:
    tok = qwen_tokenizer()
    return {"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"),
            "bos_token_id": tok.convert_tokens_to_ids("<|endoftext|>"), "tie_word_embeddings": False}


def _qwen_token_ids() -> dict[str, int]:
    tok = qwen_tokenizer()
    return {"image_token_id": tok.convert_tokens_to_ids("<|image_pad|>"),
            "video_token_id": tok.convert_tokens_to_ids("<|video_pad|>"),
            "vision_start_token_id": tok.convert_tokens_to_ids("<|vision_start|>"),
            "vision_end_token_id": tok.convert_tokens_to_ids("<|vision_end|>")}


def build_tiny_qwen2_vl(seed: int = 0) -> Any:
    """A tiny random ``Qwen2VLForConditionalGeneration`` (fp32, CPU, eval, SDPA), weights as
    :func:`build_tiny_llava`'s."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch_seed(seed)
    vision = {"depth": 2, "embed_dim": 16, "hidden_size": 64, "mlp_ratio": 2, "num_heads": 2, "patch_size": 4,
              "spatial_merge_size": 2, "temporal_patch_size": 2}
    config = Qwen2VLConfig(text_config=_qwen_text_config(), vision_config=vision, tie_word_embeddings=False,
                           **_qwen_token_ids())
    return far_from_ties(Qwen2VLForConditionalGeneration(config))


def build_tiny_qwen2_5_vl(seed: int = 0) -> Any:
    """A tiny random ``Qwen2_5_VLForConditionalGeneration``: :func:`build_tiny_qwen2_vl`'s decoder, a
    vision tower attending in windows of 2 x 2 merged patches (its second block over the whole image)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch_seed(seed)
    vision = {"depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64,
              "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 16,
              "fullatt_block_indexes": [1]}
    config = Qwen2_5_VLConfig(text_config=_qwen_text_config(), vision_config=vision,
                              tie_word_embeddings=False, **_qwen_token_ids())
    return far_from_ties(Qwen2_5_VLForConditionalGeneration(config))


def qwen3_vl_processor() -> Any:
    """Qwen3-VL's processor without video, over :func:`qwen2_vl_processor`'s image processor."""
    return _qwen_processor("qwen3_vl")


def _qwen3_vl_config(moe: bool) -> dict[str, Any]:
    """The tiny Qwen3-VL's config: a 3-layer decoder (``head_dim`` 16, its rotary embedding
    interleaving ``mrope_section`` [2, 3, 3]; MoE: 4 experts, 2 a token, in every layer) + a 2-layer
    vision tower on 4 x 4 patches merged 2 x 2, a learned 8 x 8 position grid, DeepStack after both
    blocks (so the first 2 decoder layers take DeepStack embeddings, the third none)."""
    text = {**_qwen_text_config(), "num_hidden_layers": 3, "head_dim": 16}
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    vision = {"depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64,
              "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "num_position_embeddings": 64, "deepstack_visual_indexes": [0, 1]}
    return {"text_config": text, "vision_config": vision, "tie_word_embeddings": False, **_qwen_token_ids()}


def build_tiny_qwen3_vl(seed: int = 0) -> Any:
    """A tiny random ``Qwen3VLForConditionalGeneration`` (:func:`_qwen3_vl_config`), weights as
    :func:`build_tiny_llava`'s."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch_seed(seed)
    return far_from_ties(Qwen3VLForConditionalGeneration(Qwen3VLConfig(**_qwen3_vl_config(moe=False))))


def build_tiny_qwen3_vl_moe(seed: int = 1) -> Any:
    """A tiny random ``Qwen3VLMoeForConditionalGeneration`` (:func:`_qwen3_vl_config` with experts;
    seed 1: seed 0's greedy text is one token repeated whatever the image)."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    torch_seed(seed)
    return far_from_ties(Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(**_qwen3_vl_config(moe=True))))


GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                 "image_token": "<image_soft_token>"}
GEMMA3_TEMPLATE = TEMPLATE.replace(IMAGE_TOKEN, "<start_of_image>")
"""The vision template with Gemma 3's image placeholder (its chat template's)."""
GEMMA3_TOKENS_PER_IMAGE = 4
"""Soft tokens per image: the 4 x 4 patches of a 32 x 32 image average-pooled 2 x 2."""
GEMMA3_WINDOW = 3
"""The sliding window of the tiny Gemma 3's first layer: shorter than an image's soft tokens, so
its last soft token does not see the first (``AND(window, OR(causal, block))``)."""


@functools.lru_cache(maxsize=1)
def gemma3_tokenizer() -> Any:
    """The API tests' BPE tokenizer with Gemma 3's image tokens added as named special tokens
    (``boi_token``, ``eoi_token``, ``image_token``: what ``Gemma3Processor`` reads) and
    :data:`GEMMA3_TEMPLATE`."""
    tok = _tokenizer_with(list(GEMMA3_TOKENS.values()), GEMMA3_TEMPLATE)
    tok._set_model_specific_special_tokens(GEMMA3_TOKENS)
    return tok


def gemma3_processor() -> Any:
    """``Gemma3Processor`` over :func:`gemma3_tokenizer` and a Pillow image processor resizing to
    32 x 32, :data:`GEMMA3_TOKENS_PER_IMAGE` soft tokens per image."""
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    images = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return Gemma3Processor(image_processor=images, tokenizer=gemma3_tokenizer(),
                           chat_template=GEMMA3_TEMPLATE, image_seq_length=GEMMA3_TOKENS_PER_IMAGE)


def build_tiny_gemma3(seed: int = 0) -> Any:
    """A tiny random ``Gemma3ForConditionalGeneration``: a 2-layer decoder (a sliding-window layer of
    :data:`GEMMA3_WINDOW` tokens, then a full one) + a 1-layer SigLIP tower on 32 x 32 images in 8 x 8
    patches, pooled to :data:`GEMMA3_TOKENS_PER_IMAGE` soft tokens; weights as
    :func:`build_tiny_llava`'s."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    tok = gemma3_tokenizer()
    torch_seed(seed)
    text = Gemma3TextConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            sliding_window=GEMMA3_WINDOW, layer_types=["sliding_attention", "full_attention"],
                            max_position_embeddings=512, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                            bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=8)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA3_TOKENS_PER_IMAGE,
                          boi_token_index=tok.convert_tokens_to_ids(GEMMA3_TOKENS["boi_token"]),
                          eoi_token_index=tok.convert_tokens_to_ids(GEMMA3_TOKENS["eoi_token"]),
                          image_token_index=tok.convert_tokens_to_ids(GEMMA3_TOKENS["image_token"]))
    return far_from_ties(Gemma3ForConditionalGeneration(config))


FAMILIES = {
    "llava": (build_tiny_llava, llava_processor, llava_tokenizer),
    "llava_next": (build_tiny_llava_next, llava_next_processor, llava_tokenizer),
    "llava_onevision": (build_tiny_llava_onevision, llava_onevision_processor, llava_tokenizer),
    "idefics3": (build_tiny_idefics3, idefics3_processor, idefics3_tokenizer),
    "qwen2_vl": (build_tiny_qwen2_vl, qwen2_vl_processor, qwen_tokenizer),
    "qwen2_5_vl": (build_tiny_qwen2_5_vl, qwen2_5_vl_processor, qwen_tokenizer),
    "qwen3_vl": (build_tiny_qwen3_vl, qwen3_vl_processor, qwen_tokenizer),
    "qwen3_vl_moe": (build_tiny_qwen3_vl_moe, qwen3_vl_processor, qwen_tokenizer),
    "smolvlm": (build_tiny_smolvlm, smolvlm_processor, idefics3_tokenizer),
    "mistral3": (build_tiny_mistral3, lambda: _pixtral_processor(2), pixtral_tokenizer),
    "llava_pixtral": (build_tiny_llava_pixtral, lambda: _pixtral_processor(1), pixtral_tokenizer),
    "gemma3": (build_tiny_gemma3, gemma3_processor, gemma3_tokenizer),
}
"""Family -> (model builder, processor, tokenizer) of the tiny vision-language models."""


def make_tiny_vlm(family: str, folder: Path) -> Path:
    """The tiny model of ``family`` and its processor saved as a Hugging Face folder."""
    build, processor, _ = FAMILIES[family]
    build().save_pretrained(folder)
    processor().save_pretrained(folder)
    return folder


def vlm_answer(folder: Path, question: str, png: bytes, new_tokens: int, *, ignore_eos: bool) -> str:
    """transformers' greedy answer of the vision-language model ``folder`` to one user turn (``question``
    then the image ``png``) through the folder's processor as the server loads it
    (``VisionProcessor.load``: Pillow backend, without video where the processor has it):
    ``new_tokens`` tokens, or fewer at EOS unless ``ignore_eos``; decoded without special tokens."""
    import io

    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from proxy.media.processor import VisionProcessor

    vision = VisionProcessor.load(folder)
    assert vision is not None
    processor = vision.processor
    model = AutoModelForImageTextToText.from_pretrained(str(folder), attn_implementation="sdpa").eval()
    content = [{"type": "text", "text": question}, {"type": "image"}]
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True)
    enc = processor(text=[text], images=[Image.open(io.BytesIO(png)).convert("RGB")], return_tensors="pt",
                    add_special_tokens=False)
    floor = {"min_new_tokens": new_tokens} if ignore_eos else {}
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **floor)
    answer: str = processor.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return answer


@contextlib.contextmanager
def served_vlm(folder: Path, name: str, log: Path, *extra: str) -> Iterator[LocalServer]:
    """A real ``python -m proxy serve`` of the tiny vision-language model ``folder`` as ``name``, as the
    image end-to-end tests run it (CPU, fp32, one thread, a 256-token context, then ``extra``), its log
    in ``log``; stopped on exit."""
    started = start_serve(["--model", str(folder), "--served-model-name", name, "--device", "cpu",
                           "--dtype", "float32", "--num-threads", "1", "--max-model-len", "256", *extra], log)
    try:
        yield started
    finally:
        started.stop()
