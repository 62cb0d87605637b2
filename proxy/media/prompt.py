"""The images of one prompt as the engine sees them: where their placeholder tokens are, what the
vision encoder takes, and what the prefix cache keys their blocks by (no torch, no Pillow: the
scheduler and block manager import it).

The processor of a vision-language model expands each image of the rendered chat into placeholder
tokens (LLaVA: ``image_seq_length`` copies of ``<image>``). The vision encoder turns image ``i`` into
one embedding row per placeholder token, so the ``k``-th placeholder token of the prompt (counting
every image's tokens, in order) takes the ``k``-th row of the concatenated embeddings, as
transformers' ``masked_scatter`` places them (``LlavaModel.forward``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any


@dataclass(frozen=True, eq=False)
class PromptImages:
    """The images of one prompt.

    Attributes:
        token_positions: the prompt position of every placeholder token, ascending (image 0's first).
        counts: placeholder tokens of each image (they sum to ``len(token_positions)``).
        hashes: the content hash of each image (``proxy.media.decode.LoadedImage.content_hash``).
        encoder_inputs: what the model's vision encoder takes (``pixel_values`` ``[N, C, H, W]``
            and any other processor output but the token ids), as the processor returned it.
    """

    token_positions: tuple[int, ...]
    counts: tuple[int, ...]
    hashes: tuple[str, ...]
    encoder_inputs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, prompt_ids: Sequence[int], image_token_id: int, counts: Sequence[int],
           hashes: Sequence[str], encoder_inputs: dict[str, Any]) -> PromptImages:
        """The images of ``prompt_ids``, whose placeholders are the tokens ``image_token_id``.

        Raises:
            ValueError: the placeholder tokens in the prompt are not ``sum(counts)`` (a processor that
                expands images otherwise than its model's encoder; a text that holds the placeholder
                token itself).
        """
        positions = tuple(i for i, t in enumerate(prompt_ids) if t == image_token_id)
        if len(positions) != sum(counts) or len(counts) != len(hashes):
            raise ValueError(f"the prompt has {len(positions)} image placeholder tokens, but its "
                             f"{len(counts)} images take {sum(counts)}")
        return cls(positions, tuple(counts), tuple(hashes), encoder_inputs)

    @property
    def num_images(self) -> int:
        """Images in the prompt."""
        return len(self.counts)

    def spans(self) -> list[tuple[int, int]]:
        """``(first, last)`` prompt position of each image's placeholder tokens."""
        out, k = [], 0
        for count in self.counts:
            out.append((self.token_positions[k], self.token_positions[k + count - 1]))
            k += count
        return out

    @cached_property
    def blocks(self) -> tuple[tuple[int, int], ...]:
        """``(first, last)`` prompt position of each run of consecutive placeholder tokens, in order:
        the image blocks whose tokens attend to each other both ways during prefill in a model that
        asks for it (Gemma 3: ``get_block_sequence_ids_for_mask`` groups ``token_type_ids == 1`` into
        such runs, so two images with no token between them would be one block)."""
        out: list[tuple[int, int]] = []
        for p in self.token_positions:
            if out and out[-1][1] == p - 1:
                out[-1] = (out[-1][0], p)
            else:
                out.append((p, p))
        return tuple(out)

    def chunk_end_outside_blocks(self, start: int, num_new: int) -> int:
        """The token count of a prompt chunk from ``start`` (``num_new`` asked, > 0) that ends outside
        every image block (:attr:`blocks`): ``num_new`` when its end is not inside one; else cut
        back to the block's first token when the chunk starts before the block, or run on to the
        block's end when it starts at or inside it (a block is computed whole, in one step)."""
        end = start + num_new
        for first, last in self.blocks:
            if first < end <= last:
                return first - start if first > start else last + 1 - start
            if first >= end:
                break
        return num_new

    def block_extra(self, start: int, end: int) -> bytes:
        """What the prefix-cache hash of the block of positions ``[start, end)`` adds after its token
        ids: the content hashes of the images with a placeholder token in it, in order (b"" for
        none), so a block of the same tokens but another image never matches."""
        return b"".join(b"image:" + h.encode() for h, (first, last) in zip(self.hashes, self.spans(),
                                                                            strict=True)
                        if first < end and last >= start)

    def first_at_or_after(self, start: int) -> int | None:
        """The prompt position of the first placeholder token at or after ``start``, or None."""
        k = bisect_left(self.token_positions, start)
        return self.token_positions[k] if k < len(self.token_positions) else None

    def rows_in(self, start: int, count: int) -> tuple[list[int], list[int]]:
        """The placeholder tokens among prompt positions ``[start, start + count)``:
        ``(offsets from start, embedding rows)``, both ascending (the rows index the concatenated
        embeddings of every image)."""
        lo = bisect_left(self.token_positions, start)
        hi = bisect_left(self.token_positions, start + count)
        return [self.token_positions[k] - start for k in range(lo, hi)], list(range(lo, hi))
