"""The seam of images in a step: "these prompt positions take these embeddings".

A vision-language model served with its images (``proxy.models.vision``) runs prompts with images as
``inputs_embeds``: the token embeddings of the step (``model.get_input_embeddings()(input_ids)``), with
the rows of image placeholder tokens replaced by the images' embeddings, which is what transformers'
forward does (``LlavaModel.forward``: ``inputs_embeds.masked_scatter(image mask, image features)``)
before the same decoder runs. Decode tokens and text-only steps keep ``input_ids`` (and so the
compiled / graph decode paths).

- A prompt's images are encoded in pieces (``proxy.media.pieces``: each view of Idefics3 / SmolVLM,
  each image of LLaVA, LLaVA-Next, Pixtral, Qwen2-VL; LLaVA-OneVision's images together), each on its
  own by the first step whose prompt chunk holds one of its placeholders, before its forward pass
  (:meth:`ImageEncoder.encode_step`; outside every decode path). A piece's rows stay on the request
  until a chunk has computed its last placeholder (all are dropped with the last prompt chunk); a
  preempted request encodes again the pieces it recomputes. The scheduler counts each piece's work
  as prefill cost of the step that encodes it and stops a chunk before a piece the step's bound has
  no room for (:meth:`ImageEncoder.pending_cost`, ``proxy.engine.scheduler.images``), so a large
  image's encoding is spread over steps instead of stalling the running streams in one.
- An encoder that raises fails the requests whose piece it was encoding (and those of the step that
  need the same piece, or read the KV blocks they write), not the step: their missing rows run as
  zeros and the engine finishes them with ``IMAGE_ENCODING_FAILED``, while the step's other
  requests go on.
- The encodings are cached by piece (:attr:`~proxy.media.prompt.EncoderPiece.key`: the content hash
  of its image, and the view), an LRU of at most :data:`MAX_CACHED_ROWS` rows, so ``n > 1`` choices
  and a repeated image encode once.
- A chunk takes the embedding rows of exactly its placeholder positions
  (:meth:`proxy.media.prompt.PromptImages.rows_in`) from pieces encoded whole, so a chunk boundary
  inside an image or a view changes nothing, and a prefix-cache hit covering part of an image
  encodes only the pieces with a placeholder past it.
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
from proxy.media.prompt import EncoderPiece, PromptImages
from proxy.models.vision import encode_piece, image_row_shape

logger = logging.getLogger(__name__)

MAX_CACHED_ROWS = 8192
"""Embedding rows of image pieces kept by :attr:`~proxy.media.prompt.EncoderPiece.key` (least
recently used out; the newest piece is kept whatever its size)."""


class ImageEncoder:
    """Encodes requests' image pieces with the model's vision encoder, cached by content hash.

    Args:
        model: the served vision-language model (``get_image_features``, ``get_input_embeddings``).
        device, dtype: of its parameters.
    """

    def __init__(self, model: Any, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._cached_rows = 0
        self.num_encoded = 0  # pieces that ran through the encoder (not the cache)
        #: prefill-token cost of one vision-encoder patch (:func:`patch_cost`)
        self.patch_cost = patch_cost(model)
        vision = getattr(model.config, "vision_config", None)
        self.patch_values = getattr(vision, "num_channels", 3) * getattr(vision, "patch_size", 0) ** 2

    def cost(self, piece: EncoderPiece) -> int:
        """The prefill-token cost of encoding ``piece``: its patches (``pixel_values`` elements over
        one patch's, padding included) times :attr:`patch_cost`, at least 1; its placeholder tokens
        where its inputs have no ``pixel_values`` or the config no ``patch_size``."""
        pixels = piece.inputs.get("pixel_values")
        if pixels is None or not self.patch_values:
            return max(1, piece.rows)
        return max(1, math.ceil(int(pixels.numel()) / self.patch_values * self.patch_cost))

    def pending_cost(self, request: Request, piece: int) -> int:
        """The prefill-token cost of encoding piece ``piece`` of ``request``'s images now (the
        scheduler's ``encoder_cost``): 0 without images, with its rows on the request or in the cache."""
        images = request.images
        if images is None or piece in request.image_embeds or images.pieces[piece].key in self._cache:
            return 0
        return self.cost(images.pieces[piece])

    def encode_step(self, scheduler_output: SchedulerOutput, block_size: int) -> dict[Request, str]:
        """Encode the image pieces that the step's prompt chunks hold and that have no rows on their
        request yet (before the step's forward pass), each piece on its own.

        Returns:
            the requests with a piece the encoder could not encode, those of the step that needed a
            piece whose encoding failed, and those of the step that read the KV blocks they write
            (``block_size`` tokens each; a request admitted beside one of them on its cached prefix;
            the encoder's message where it holds the failed piece too), each with its message; the
            failed ones' missing rows are zeros, so the step runs, and the engine fails them all
            (``Scheduler.fail_images``).
        """
        rows = list(zip(scheduler_output.requests, scheduler_output.num_new_tokens, strict=True))
        errors: dict[str, str] = {}  # piece key -> what the encoder raised on it
        out: dict[Request, str] = {}
        for request, num_new in rows:
            images = request.images
            if images is None or request.num_computed_tokens >= request.num_prompt_tokens:
                continue
            for index in images.pieces_in(request.num_computed_tokens, num_new):
                piece = images.pieces[index]
                if index in request.image_embeds:
                    continue
                error = errors.get(piece.key)
                if error is None:
                    try:
                        request.image_embeds[index] = self.encode(piece)
                        continue
                    except Exception as exc:
                        logger.exception("the vision encoder failed on request %s's images",
                                         request.request_id)
                        error = errors[piece.key] = f"{type(exc).__name__}: {exc}"
                out[request] = _encoder_message(images, error)
                break
        poisoned: set[int] = set()  # KV blocks the step writes after zero image rows
        for request, num_new in rows:
            images = request.images
            if request in out and images is not None:
                poisoned.update(_written_blocks(request, num_new, images.token_positions[0], block_size))
                for index in images.pieces_in(request.num_computed_tokens, num_new):
                    if index not in request.image_embeds:
                        request.image_embeds[index] = torch.zeros(images.pieces[index].rows,
                                                                  *image_row_shape(self.model),
                                                                  device=self.device, dtype=self.dtype)
        grew = bool(poisoned)
        while grew:  # requests attending to those blocks, and to the blocks they write in turn
            grew = False
            for request, num_new in rows:
                shared = [i for i, b in enumerate(request.block_ids) if b in poisoned]
                if request in out or not shared:
                    continue
                images = request.images  # holding the failed image itself, it fails as its request did
                own = [errors[p.key] for p in images.pieces if p.key in errors] if images is not None else []
                out[request] = (_encoder_message(images, own[0]) if images is not None and own else
                                "This request started on the cached prompt blocks of another request of "
                                "the same step, whose images the model's vision encoder could not encode "
                                f"({next(iter(out.values()))}); send it again.")
                poisoned.update(_written_blocks(request, num_new, shared[0] * block_size, block_size))
                grew = True
        return out

    def encode(self, piece: EncoderPiece) -> torch.Tensor:
        """The embeddings of ``piece``, ``[piece.rows, hidden]`` (cached by its key)."""
        found = self._cache.get(piece.key)
        if found is not None:
            self._cache.move_to_end(piece.key)
            return found
        embeds = encode_piece(self.model, piece, self.device, self.dtype)
        self.num_encoded += 1
        self._cache[piece.key] = embeds
        self._cached_rows += embeds.shape[0]
        while self._cached_rows > MAX_CACHED_ROWS and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_rows -= old.shape[0]
        return embeds

    def slots(self, rows: StepRows) -> ImageSlots | None:
        """The image positions of a step's rows and their embeddings (None when no row holds one);
        a piece's rows are encoded at the first chunk holding one of its placeholders and dropped
        after the chunk holding its last (module docstring)."""
        index: list[int] = []
        parts: list[torch.Tensor] = []
        offset = 0
        for request, start, count in zip(rows.requests, rows.starts, rows.counts, strict=True):
            images = request.images
            if images is not None and start < request.num_prompt_tokens:
                offsets, take = images.rows_in(start, count)
                if offsets:
                    index.extend(offset + o for o in offsets)
                    parts.extend(self._rows(request, take[0], take[-1] + 1))
                end = start + count
                for done in [i for i in request.image_embeds if images.piece_end(i) <= end]:
                    del request.image_embeds[done]
            offset += count
        if not index:
            return None
        return ImageSlots(torch.tensor(index, dtype=torch.long), torch.cat(parts, dim=0))

    def _rows(self, request: Request, lo: int, hi: int) -> list[torch.Tensor]:
        """Embedding rows ``[lo, hi)`` of ``request``'s images, from the pieces that hold them (a piece
        not on the request yet is encoded, from the cache where it is there)."""
        images = request.images
        assert images is not None
        out = []
        for index in range(images.piece_of_row(lo), images.piece_of_row(hi - 1) + 1):
            embeds = request.image_embeds.get(index)
            if embeds is None:
                embeds = request.image_embeds[index] = self.encode(images.pieces[index])
            first = images.piece_starts[index]
            out.append(embeds[max(lo, first) - first: min(hi, images.piece_starts[index + 1]) - first])
        return out

    def embed(self, input_ids: torch.Tensor, slots: ImageSlots) -> torch.Tensor:
        """``inputs_embeds [1, T, hidden]`` of a step: the token embeddings of ``input_ids [1, T]``
        with the rows of ``slots`` replaced by its image embeddings."""
        embeds: torch.Tensor = self.model.get_input_embeddings()(input_ids)
        embeds[0, slots.flat_index.to(embeds.device)] = slots.input_embeds.to(embeds.dtype)
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


def _encoder_message(images: PromptImages, error: str) -> str:
    """The error of a request whose image piece the vision encoder raised ``error`` on."""
    return (f"The model's vision encoder could not encode the {images.num_images} image(s) of this request: "
            f"{error}")


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
