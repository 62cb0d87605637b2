"""How a prompt's images are cut into the vision encoder's units of work
(:class:`~proxy.media.prompt.EncoderPiece`), per architecture (torch-free at import: tensors are only
sliced).

A piece is the smallest input whose embeddings the model computes independently of the rest, read from
transformers' ``get_image_features`` of each type (:data:`UNITS`):

- ``view`` (Idefics3, SmolVLM): every view of an image (each tile and the global view) runs through
  the vision tower and the connector on its own (``Idefics3Model.get_image_features``: the views are a
  batch, attention within a view) and gives its own ``image_seq_len`` rows, in view order;
  ``pixel_values`` ``[1, views, C, H, W]`` and ``pixel_attention_mask`` ``[1, views, H, W]`` are
  sliced on their views.
- ``image`` (LLaVA, LLaVA-Next, Mistral3 and LLaVA with a Pixtral tower, Qwen2-VL, Qwen2.5-VL): each
  image on its own. LLaVA-Next's views are encoded independently too, but its rows are the grid views'
  features packed row by row across views with newlines (``pack_image_features``), so a placeholder
  row does not belong to one view; Pixtral's tower attends within each image (a block-diagonal mask)
  and merges patches per image; Qwen2-VL's runs over all patches of an image (``cu_seqlens`` per
  image, Qwen2.5-VL's windows within it). Inputs with one entry per image are sliced on it; Qwen's
  ``pixel_values`` (``[patches, C * T * P * P]``) on the image's ``t * h * w`` patches of
  ``image_grid_thw``.
- ``prompt`` (LLaVA-OneVision and any type not listed): the prompt's images together, as
  ``generate()`` encodes them: OneVision's encoding of an image depends on how many images the prompt
  has (one: its anyres grid; several: a base view each, ``batch_num_images``).

The cache key of a piece is what its embeddings depend on: its image's content hash (and the view's
index and padded size), or every image's hash for a ``prompt`` piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .prompt import EncoderPiece

UNITS: dict[str, str] = {
    "idefics3": "view", "smolvlm": "view",
    "llava": "image", "llava_next": "image", "mistral3": "image", "qwen2_vl": "image", "qwen2_5_vl": "image",
}
"""Model types -> the unit their vision encoder's work is cut into (module docstring); others:
``prompt``."""


def split(model_type: str, counts: Sequence[int], hashes: Sequence[str], inputs: dict[str, Any],
          view_rows: int = 0) -> tuple[EncoderPiece, ...]:
    """The pieces of a prompt's images for a model of ``model_type`` (:data:`UNITS`): ``counts``
    placeholders and ``hashes`` per image, ``inputs`` the processor's encoder inputs, ``view_rows``
    the placeholders of one view (``image_seq_len``; ``view`` types). One ``prompt`` piece where the
    inputs are not shaped as the unit needs (a processor of another layout)."""
    unit = UNITS.get(model_type, "prompt")
    pieces: tuple[EncoderPiece, ...] | None = None
    if unit == "view" and view_rows > 0:
        pieces = _views(counts, hashes, inputs, view_rows)
    elif unit == "image" and "image_grid_thw" in inputs:
        pieces = _grid_images(counts, hashes, inputs)
    elif unit == "image":
        pieces = _images(counts, hashes, inputs)
    return pieces if pieces is not None else (EncoderPiece("+".join(hashes), sum(counts), inputs),)


def _views(counts: Sequence[int], hashes: Sequence[str], inputs: dict[str, Any],
           view_rows: int) -> tuple[EncoderPiece, ...] | None:
    pixels, mask = inputs.get("pixel_values"), inputs.get("pixel_attention_mask")
    views = [count // view_rows for count in counts]
    if (pixels is None or pixels.dim() != 5 or pixels.shape[0] != 1 or pixels.shape[1] != sum(views)
            or any(n * view_rows != count for n, count in zip(views, counts, strict=True))
            or set(inputs) - {"pixel_values", "pixel_attention_mask"}):
        return None
    size = "x".join(str(d) for d in pixels.shape[-2:])  # the views are padded to the prompt's largest
    out: list[EncoderPiece] = []
    first = 0
    for n, image_hash in zip(views, hashes, strict=True):
        for k in range(n):
            v = first + k
            piece = {"pixel_values": pixels[:, v:v + 1]}
            if mask is not None:
                piece["pixel_attention_mask"] = mask[:, v:v + 1]
            out.append(EncoderPiece(f"{image_hash}#view{k}@{size}", view_rows, piece))
        first += n
    return tuple(out)


def _images(counts: Sequence[int], hashes: Sequence[str],
            inputs: dict[str, Any]) -> tuple[EncoderPiece, ...] | None:
    n = len(counts)
    if "pixel_values" not in inputs or any(len(getattr(v, "shape", ())) == 0 or v.shape[0] != n
                                           for v in inputs.values()):
        return None
    return tuple(EncoderPiece(h, count, {key: value[i:i + 1] for key, value in inputs.items()})
                 for i, (count, h) in enumerate(zip(counts, hashes, strict=True)))


def _grid_images(counts: Sequence[int], hashes: Sequence[str],
                 inputs: dict[str, Any]) -> tuple[EncoderPiece, ...] | None:
    grid, pixels = inputs["image_grid_thw"], inputs.get("pixel_values")
    sizes = [int(t) * int(h) * int(w) for t, h, w in grid.tolist()]
    if pixels is None or len(sizes) != len(counts) or pixels.shape[0] != sum(sizes) or len(inputs) != 2:
        return None
    out: list[EncoderPiece] = []
    first = 0
    for i, (size, count, h) in enumerate(zip(sizes, counts, hashes, strict=True)):
        out.append(EncoderPiece(h, count, {"pixel_values": pixels[first:first + size],
                                           "image_grid_thw": grid[i:i + 1]}))
        first += size
    return tuple(out)
