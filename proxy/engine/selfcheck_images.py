"""The load-time self-check's image prompt (a vision-language model served with its images): one
synthetic image through the processor, the engine's greedy ids against ``generate()`` with the same
processor inputs, as :mod:`proxy.engine.selfcheck` does for its text prompts.

What runs: a 64 x 48 picture of four coloured quarters (decoded as a request's image is), the
processor's image placeholder followed by a short text, expanded by the processor; the engine in
prefill chunks of a third of the prompt (so a chunk boundary falls inside the image) with
``NUM_NEW_TOKENS`` greedy tokens, EOS ignored; the reference ``generate(do_sample=False)`` with the
model switched to ``eager`` attention (vision tower included) and a default ``GenerationConfig``, then
switched back. A difference is accepted only at a near-tie, as for the text prompts.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import torch

from proxy.engine.execution.attention import ATTN_IMPLEMENTATION
from proxy.media.decode import decode_image
from proxy.media.processor import VisionProcessor
from proxy.media.prompt import PromptImages
from proxy.models.vision import decoder_attention
from proxy.sampling import SamplingParams
from proxy.settings import Settings

IMAGE_SIZE = (64, 48)
QUESTION = "Describe the picture."


def _picture() -> bytes:
    from PIL import Image

    image = Image.new("RGB", IMAGE_SIZE)
    w, h = IMAGE_SIZE
    colours = [(230, 40, 40), (40, 120, 230), (30, 200, 60), (250, 220, 0)]
    for quarter, colour in enumerate(colours):
        x, y = (quarter % 2) * w // 2, (quarter // 2) * h // 2
        image.paste(colour, (x, y, x + w // 2, y + h // 2))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _engine_ids(model: Any, settings: Settings, ids: list[int], images: PromptImages, num_new: int,
                max_model_len: int) -> list[int]:
    from proxy.engine.core import EngineCore

    bs = settings.block_size
    blocks = -(-(len(ids) + num_new + 1) // bs) + 2
    check = dataclasses.replace(settings, num_kv_blocks=blocks, max_num_seqs=1,
                                max_num_batched_tokens=max(8, -(-len(ids) // 3)))
    core = EngineCore(model, check, [], min(max_model_len, blocks * bs))
    params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    core.add_request("image", ids, params, images)
    out: list[int] = []
    for _ in range(10 * (len(ids) + num_new)):
        if not core.has_unfinished():
            break
        for o in core.step():
            if o.finish_reason == "error":
                raise RuntimeError(f"the engine failed on the image prompt: {o.error}")
            out.extend(o.new_token_ids)
    return out


def _reference(model: Any, vision: VisionProcessor, text: str, image: Any,
               num_new: int) -> tuple[list[int], list[float]]:
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    enc = vision.processor(text=[text], images=[image], return_tensors="pt", add_special_tokens=False)
    enc = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in enc.items()}
    saved = model.generation_config
    model.set_attn_implementation("eager")
    try:
        model.generation_config = GenerationConfig(pad_token_id=0)
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
    finally:
        model.generation_config = saved
        model.set_attn_implementation(decoder_attention(model.config, ATTN_IMPLEMENTATION))
    ids: list[int] = out.sequences[0, enc["input_ids"].shape[1]:].tolist()
    gaps = [float(s[0].float().topk(2).values[0] - s[0].float().topk(2).values[1]) for s in out.scores]
    return ids, gaps


def check_image_prompt(model: Any, vision: VisionProcessor, settings: Settings, max_model_len: int,
                       num_new: int, tolerance: float) -> tuple[int, bool]:
    """Run the image prompt (module docstring) -> ``(its length in tokens, stopped at a near-tie)``.

    Raises:
        RuntimeError: a token differs outside a near-tie, the lengths differ, or a run raised; the
            message says which (the caller names the model and what to do).
    """
    loaded = decode_image(_picture(), "self-check")
    token = getattr(vision.processor, "image_token", "<image>")
    text = f"{token}{QUESTION}"
    ids, images = vision.prompt(text, [loaded])
    got = _engine_ids(model, settings, ids, images, num_new, max_model_len)
    want, gaps = _reference(model, vision, text, loaded.image, num_new)
    for step, (a, b) in enumerate(zip(got, want)):
        if a != b:
            if gaps[step] < tolerance:
                return len(ids), True
            raise RuntimeError(f"the image prompt ({len(ids)} tokens, {sum(images.counts)} of them the "
                               f"image's) first differs at generated token {step}: engine {a}, generate() "
                               f"{b} (top-2 logit gap {gaps[step]:.3g})")
    if len(got) != len(want):
        raise RuntimeError(f"the image prompt: the engine generated {len(got)} tokens, generate() "
                           f"{len(want)}")
    return len(ids), False
