"""A tiny random LLaVA (a 2-layer Llama over the API tests' BPE tokenizer + a 2-layer CLIP vision tower
on 32 x 32 images in 8 x 8 patches + the projector) and its processor, built from configs (no hub
downloads): 16 placeholder tokens per image (4 x 4 patches, the CLS feature dropped by the ``default``
strategy). The processor uses Pillow (``CLIPImageProcessorPil``), as the server does."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

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


@functools.lru_cache(maxsize=1)
def llava_tokenizer() -> Any:
    """The API tests' byte-level BPE tokenizer with ``<image>`` added and the vision template."""
    from tests.api.fakes import make_hf_tokenizer

    tok = copy.deepcopy(make_hf_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tok.chat_template = TEMPLATE
    return tok


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
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    model.set_attn_implementation("sdpa")
    return model.eval()


def make_tiny_llava(folder: Path) -> Path:
    """:func:`build_tiny_llava` and :func:`llava_processor` saved as a Hugging Face folder."""
    build_tiny_llava().save_pretrained(folder)
    llava_processor().save_pretrained(folder)
    return folder
