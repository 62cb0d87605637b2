"""The images of one prompt as the engine sees them: where their placeholder tokens are, what the
vision encoder takes, and what the prefix cache keys their blocks by (no torch, no Pillow: the
scheduler and block manager import it).

The processor of a vision-language model expands each image of the rendered chat into placeholder
tokens (LLaVA: ``image_seq_length`` copies of ``<image>``). The vision encoder turns image ``i`` into
one embedding row per placeholder token, so the ``k``-th placeholder token of the prompt (counting
every image's tokens, in order) takes the ``k``-th row of the concatenated embeddings, as
transformers' ``masked_scatter`` places them (``LlavaModel.forward``).

The vision encoder's work is cut into :class:`EncoderPiece` s, each encoded on its own into a run of
consecutive embedding rows (``proxy.media.pieces`` says how each architecture is cut: a view, an image,
or the whole prompt's images), so that a prompt chunk encodes only the pieces whose placeholders it
holds (``proxy.engine.execution.image_embeds``).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any


@dataclass(frozen=True, eq=False)
class EncoderPiece:
    """One unit of the vision encoder's work: encoded alone, it gives ``rows`` consecutive embedding
    rows of the prompt (``proxy.media.pieces``).

    Attributes:
        key: what the encoder cache keys its embeddings by: the content hash of its image (with the
            view's index for a view; every image's hash for a piece of the whole prompt).
        rows: placeholder tokens it fills.
        inputs: what the model's vision encoder takes for it (``get_image_features``' arguments).
    """

    key: str
    rows: int
    inputs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class PromptImages:
    """The images of one prompt.

    Attributes:
        token_positions: the prompt position of every placeholder token, ascending (image 0's first).
        counts: placeholder tokens of each image (they sum to ``len(token_positions)``).
        hashes: the content hash of each image (``proxy.media.decode.LoadedImage.content_hash``).
        encoder_inputs: what the model's vision encoder takes (``pixel_values`` ``[N, C, H, W]``
            and any other processor output but the token ids), as the processor returned it.
        pieces: the encoder's units of work, in row order (their rows sum to the placeholders); one
            piece of every image together when none are given.
        piece_starts: the first embedding row of each piece, then the number of rows (derived).
    """

    token_positions: tuple[int, ...]
    counts: tuple[int, ...]
    hashes: tuple[str, ...]
    encoder_inputs: dict[str, Any] = field(default_factory=dict)
    pieces: tuple[EncoderPiece, ...] = ()
    piece_starts: tuple[int, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.pieces:
            whole = EncoderPiece("+".join(self.hashes), len(self.token_positions), self.encoder_inputs)
            object.__setattr__(self, "pieces", (whole,))
        if sum(p.rows for p in self.pieces) != len(self.token_positions):
            raise ValueError(f"the vision encoder's pieces fill {sum(p.rows for p in self.pieces)} rows, "
                             f"but the prompt has {len(self.token_positions)} image placeholder tokens")
        starts = [0]
        for piece in self.pieces:
            starts.append(starts[-1] + piece.rows)
        object.__setattr__(self, "piece_starts", tuple(starts))

    @classmethod
    def of(cls, prompt_ids: Sequence[int], image_token_id: int, counts: Sequence[int],
           hashes: Sequence[str], encoder_inputs: dict[str, Any],
           pieces: Sequence[EncoderPiece] = ()) -> PromptImages:
        """The images of ``prompt_ids``, whose placeholders are the tokens ``image_token_id``, encoded
        in ``pieces`` (none: all together).

        Raises:
            ValueError: the placeholder tokens in the prompt are not ``sum(counts)`` (a processor that
                expands images otherwise than its model's encoder; a text that holds the placeholder
                token itself), or not the pieces' rows.
        """
        positions = tuple(i for i, t in enumerate(prompt_ids) if t == image_token_id)
        if len(positions) != sum(counts) or len(counts) != len(hashes):
            raise ValueError(f"the prompt has {len(positions)} image placeholder tokens, but its "
                             f"{len(counts)} images take {sum(counts)}")
        return cls(positions, tuple(counts), tuple(hashes), encoder_inputs, tuple(pieces))

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
        ids: the keys of the encoder pieces with a placeholder token in it, in order (b"" for none).
        A piece's key names everything its rows depend on (its image's content hash; a view's index
        and padded size; every image of the prompt for a piece of the whole prompt, whose rows depend
        on the other images, as LLaVA-OneVision's do), so a block of the same tokens but rows computed
        from other inputs never matches."""
        out = []
        for piece, first, last in zip(self.pieces, self.piece_starts, self.piece_starts[1:], strict=False):
            if first < last and self.token_positions[first] < end and self.token_positions[last - 1] >= start:
                out.append(b"image:" + piece.key.encode())
        return b"".join(out)

    def first_at_or_after(self, start: int) -> int | None:
        """The prompt position of the first placeholder token at or after ``start``, or None."""
        k = bisect_left(self.token_positions, start)
        return self.token_positions[k] if k < len(self.token_positions) else None

    def piece_rows(self, piece: int) -> range:
        """The embedding rows of piece ``piece`` (indices into every image's concatenated rows)."""
        return range(self.piece_starts[piece], self.piece_starts[piece + 1])

    def piece_of_row(self, row: int) -> int:
        """The piece whose embeddings hold row ``row``."""
        return bisect_right(self.piece_starts, row) - 1

    def pieces_in(self, start: int, count: int) -> range:
        """The pieces with a placeholder token among prompt positions ``[start, start + count)``
        (an empty range for none)."""
        lo = bisect_left(self.token_positions, start)
        hi = bisect_left(self.token_positions, start + count)
        return range(0) if lo == hi else range(self.piece_of_row(lo), self.piece_of_row(hi - 1) + 1)

    def piece_first_at_or_after(self, piece: int, start: int) -> int:
        """The prompt position of piece ``piece``'s first placeholder token at or after ``start``
        (the piece has one: :meth:`pieces_in`)."""
        row = max(self.piece_rows(piece).start, bisect_left(self.token_positions, start))
        return self.token_positions[row]

    def piece_end(self, piece: int) -> int:
        """The prompt position just past piece ``piece``'s last placeholder token."""
        return self.token_positions[self.piece_rows(piece).stop - 1] + 1

    def rows_in(self, start: int, count: int) -> tuple[list[int], list[int]]:
        """The placeholder tokens among prompt positions ``[start, start + count)``:
        ``(offsets from start, embedding rows)``, both ascending (the rows index the concatenated
        embeddings of every image)."""
        lo = bisect_left(self.token_positions, start)
        hi = bisect_left(self.token_positions, start + count)
        return [self.token_positions[k] - start for k in range(lo, hi)], list(range(lo, hi))
