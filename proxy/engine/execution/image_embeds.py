"""The seam of images in a step: "these prompt positions take these embeddings".

A vision-language model served with its images (``proxy.models.vision``) runs prompts with images as
``inputs_embeds``: the token embeddings of the step (``model.get_input_embeddings()(input_ids)``), with
the rows of image placeholder tokens replaced by the images' embeddings, which is what transformers'
forward does (``LlavaModel.forward``: ``inputs_embeds.masked_scatter(image mask, image features)``)
before the same decoder runs. Decode tokens and text-only steps keep ``input_ids`` (and so the
compiled / graph decode paths).

- The images of a request are encoded once, together (as ``generate()`` encodes one prompt's images),
  by the first step that runs a prompt chunk holding a placeholder (:class:`ImageEncoder`; outside
  every decode path), kept on the request while its prompt runs and dropped with its last prompt
  chunk; a preempted request encodes again when it recomputes them.
- The encodings are cached by the images' content hashes (an LRU of ``MAX_CACHED`` prompts' images), so
  ``n > 1`` choices and a repeated image set encode once.
- A chunk takes the embedding rows of exactly its placeholder positions
  (:meth:`proxy.media.prompt.PromptImages.rows_in`), so a chunk boundary inside an image changes
  nothing, and a prefix-cache hit covering part of an image computes only the rest.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from proxy.engine.execution.step_inputs import ImageSlots, StepRows
from proxy.engine.request import Request
from proxy.models.vision import encode_images

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
