"""The seam of images in a step: "these prompt positions take these embeddings".

A vision-language model served with its images (``proxy.models.vision``) runs prompts with images as
``inputs_embeds``: the token embeddings of the step (``model.get_input_embeddings()(input_ids)``), with
the rows of image placeholder tokens replaced by the images' embeddings, which is what transformers'
forward does (``LlavaModel.forward``: ``inputs_embeds.masked_scatter(image mask, image features)``)
before the same decoder runs. Decode tokens and text-only steps keep ``input_ids`` (and so the
compiled / graph decode paths).

- The images of a request are encoded once, together (as ``generate()`` encodes one prompt's images),
  by the first step that runs a prompt chunk holding a placeholder, before its forward pass
  (:meth:`ImageEncoder.encode_step`; outside every decode path), kept on the request while its prompt
  runs and dropped with its last prompt chunk; a preempted request encodes again when it recomputes
  them. The scheduler counts that work as prefill cost of the step (:meth:`ImageEncoder.pending_cost`,
  ``proxy.engine.scheduler.images``).
- An encoder that raises fails the requests whose images it was encoding (and those of the step with
  the same images, or reading the KV blocks they write), not the step: their image rows run as zeros
  and the engine finishes them with ``IMAGE_ENCODING_FAILED``, while the step's other requests go on.
- The encodings are cached by the images' content hashes (an LRU of ``MAX_CACHED`` prompts' images), so
  ``n > 1`` choices and a repeated image set encode once.
- A chunk takes the embedding rows of exactly its placeholder positions
  (:meth:`proxy.media.prompt.PromptImages.rows_in`), so a chunk boundary inside an image changes
  nothing, and a prefix-cache hit covering part of an image computes only the rest.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from typing import Any

import torch

from proxy.engine.execution.step_inputs import ImageSlots, StepRows
from proxy.engine.request import Request
from proxy.engine.scheduler import SchedulerOutput
from proxy.media.prompt import PromptImages
from proxy.models.vision import encode_images

logger = logging.getLogger(__name__)

MAX_CACHED = 8
"""Prompts' image encodings kept by content hash (least recently used out)."""


class ImageEncoder:
    """Encodes requests' images with the model's vision encoder, cached by content hash.

    Args:
        model: the served vision-language model (``get_image_features``, ``get_input_embeddings``).
        device, dtype: of its parameters.
    """

    def __init__(self, model: Any, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self._cache: OrderedDict[tuple[str, ...], torch.Tensor] = OrderedDict()
        self.num_encoded = 0  # prompts whose images ran through the encoder (not the cache)
        #: prefill-token cost of one vision-encoder patch (:func:`patch_cost`)
        self.patch_cost = patch_cost(model)
        vision = getattr(model.config, "vision_config", None)
        self.patch_values = getattr(vision, "num_channels", 3) * getattr(vision, "patch_size", 0) ** 2

    def cost(self, images: PromptImages) -> int:
        """The prefill-token cost of encoding ``images``: their patches (``pixel_values`` elements
        over one patch's, padding included) times :attr:`patch_cost`, at least 1; their placeholder
        tokens where the encoder inputs have no ``pixel_values`` or the config no ``patch_size``."""
        pixels = images.encoder_inputs.get("pixel_values")
        if pixels is None or not self.patch_values:
            return max(1, len(images.token_positions))
        return max(1, math.ceil(int(pixels.numel()) / self.patch_values * self.patch_cost))

    def pending_cost(self, request: Request) -> int:
        """The prefill-token cost of encoding ``request``'s images now (the scheduler's
        ``encoder_cost``): 0 without images, with their embeddings on the request or in the cache."""
        images = request.images
        if images is None or request.image_embeds is not None or images.hashes in self._cache:
            return 0
        return self.cost(images)

    def encode_step(self, scheduler_output: SchedulerOutput, block_size: int) -> dict[Request, str]:
        """Encode the images of the step's requests whose chunk holds a placeholder and whose images
        have no embeddings yet (before the step's forward pass), each request on its own.

        Returns:
            the requests whose images the encoder could not encode, those of the step with the same
            images, and those of the step that read the KV blocks they write (``block_size`` tokens
            each; a request admitted beside one of them on its cached prefix), each with its message;
            the failed ones' image rows are zeros, so the step runs, and the engine fails them all
            (``Scheduler.fail_images``).
        """
        rows = list(zip(scheduler_output.requests, scheduler_output.num_new_tokens, strict=True))
        failed: dict[tuple[str, ...], str] = {}
        for request, num_new in rows:
            images = request.images
            if images is None or request.image_embeds is not None or images.hashes in failed:
                continue
            first = images.first_at_or_after(request.num_computed_tokens)
            if first is None or first >= request.num_computed_tokens + num_new:
                continue
            try:
                request.image_embeds = self.encode(request)
            except Exception as exc:
                logger.exception("the vision encoder failed on request %s's images", request.request_id)
                failed[images.hashes] = (f"The model's vision encoder could not encode the "
                                         f"{images.num_images} image(s) of this request: "
                                         f"{type(exc).__name__}: {exc}")
        out: dict[Request, str] = {}
        poisoned: set[int] = set()  # KV blocks the step writes after zero image rows
        for request, num_new in rows:
            images = request.images
            if images is not None and images.hashes in failed:
                out[request] = failed[images.hashes]
                poisoned.update(_written_blocks(request, num_new, images.token_positions[0], block_size))
                if request.image_embeds is None:
                    hidden = self.model.get_input_embeddings().weight.shape[1]
                    request.image_embeds = torch.zeros(len(images.token_positions), hidden,
                                                       device=self.device, dtype=self.dtype)
        grew = bool(poisoned)
        while grew:  # requests attending to those blocks, and to the blocks they write in turn
            grew = False
            for request, num_new in rows:
                shared = [i for i, b in enumerate(request.block_ids) if b in poisoned]
                if request in out or not shared:
                    continue
                out[request] = ("This request started on the cached prompt blocks of another request of "
                                "the same step, whose images the model's vision encoder could not encode "
                                f"({next(iter(failed.values()))}); send it again.")
                poisoned.update(_written_blocks(request, num_new, shared[0] * block_size, block_size))
                grew = True
        return out

    def encode(self, request: Request) -> torch.Tensor:
        """The embeddings of ``request``'s images, ``[placeholders, hidden]`` (cached by content hash)."""
        images = request.images
        assert images is not None
        key = images.hashes
        found = self._cache.get(key)
        if found is not None:
            self._cache.move_to_end(key)
            return found
        embeds = encode_images(self.model, images, self.device, self.dtype)
        self.num_encoded += 1
        self._cache[key] = embeds
        if len(self._cache) > MAX_CACHED:
            self._cache.popitem(last=False)
        return embeds

    def slots(self, rows: StepRows) -> ImageSlots | None:
        """The image positions of a step's rows and their embeddings (None when no row holds one);
        a request's embeddings are encoded at its first such chunk and dropped after its last prompt
        chunk (module docstring)."""
        index: list[int] = []
        parts: list[torch.Tensor] = []
        offset = 0
        for request, start, count in zip(rows.requests, rows.starts, rows.counts, strict=True):
            images = request.images
            if images is not None and start < request.num_prompt_tokens:
                offsets, take = images.rows_in(start, count)
                if offsets:
                    if request.image_embeds is None:
                        request.image_embeds = self.encode(request)
                    index.extend(offset + o for o in offsets)
                    parts.append(request.image_embeds[take[0]: take[-1] + 1])
                if start + count >= request.num_prompt_tokens:
                    request.image_embeds = None
            offset += count
        if not index:
            return None
        return ImageSlots(torch.tensor(index, dtype=torch.long), torch.cat(parts, dim=0))

    def embed(self, input_ids: torch.Tensor, slots: ImageSlots) -> torch.Tensor:
        """``inputs_embeds [1, T, hidden]`` of a step: the token embeddings of ``input_ids [1, T]``
        with the rows of ``slots`` replaced by its image embeddings."""
        embeds: torch.Tensor = self.model.get_input_embeddings()(input_ids)
        embeds[0, slots.flat_index.to(embeds.device)] = slots.embeds.to(embeds.dtype)
        return embeds


def patch_cost(model: Any) -> float:
    """The prefill-token cost of one vision-encoder patch: the parameters of the model outside its
    decoder (vision tower, projector) over the decoder's, embedding tables left out. A transformer's
    forward costs about two FLOPs per parameter per token (Kaplan et al. 2020, "Scaling Laws for Neural
    Language Models", ``C_forward ~ 2N``), so this ratio is what one patch costs in decoder tokens,
    attention left out; 1.0 where the split cannot be read (no ``get_decoder``). A packed linear
    (``--quantization``: its weight is buffers of codes) counts its ``in_features * out_features``."""
    try:
        decoder = model.get_decoder()
        embed = model.get_input_embeddings().weight
    except (AttributeError, ValueError):
        return 1.0
    head = model.get_output_embeddings()
    tied = head is None or getattr(head, "weight", None) is embed
    head_numel = 0 if tied else _num_weights(head)
    total, in_decoder = _num_weights(model), _num_weights(decoder)
    vision, text = total - in_decoder - head_numel, in_decoder - embed.numel()
    return vision / text if vision > 0 and text > 0 else 1.0


def _num_weights(module: torch.nn.Module) -> int:
    """The parameters of ``module``, each linear layer that holds its weight (``nn.Linear``, a
    packed one, whose weight is buffers of codes) counted as ``in_features * out_features`` plus its
    bias; a layer holding no tensor of its own (a fused projection's slice) counts 0."""
    total = 0
    for m in module.modules():
        own = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        rows, cols = getattr(m, "out_features", None), getattr(m, "in_features", None)
        if isinstance(rows, int) and isinstance(cols, int):
            bias = getattr(m, "bias", None)
            total += rows * cols + (bias.numel() if isinstance(bias, torch.Tensor) else 0) if own else 0
        else:
            total += sum(p.numel() for p in m.parameters(recurse=False))
    return total


def _written_blocks(request: Request, num_new: int, start: int, block_size: int) -> list[int]:
    """The KV blocks of ``request`` that a step computing ``num_new`` of its tokens writes from prompt
    position ``start`` on."""
    first = max(start, request.num_computed_tokens) // block_size
    last = (request.num_computed_tokens + num_new - 1) // block_size
    return request.block_ids[first:last + 1]
