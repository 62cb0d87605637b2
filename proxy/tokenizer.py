"""Tokenizer wrapper: chat template, encode, EOS ids, and the decode table the hot path streams with.

``Tokenizer(hf_tokenizer)`` wraps a transformers tokenizer. At construction it derives a
:class:`proxy.hotpath.DecodeTable` from the tokenizer's decoder (byte-level BPE: GPT-2, Llama 3, Qwen2,
SmolLM2; SentencePiece with byte fallback: Llama 2, Phi-3; Metaspace) and verifies it against
``tokenizer.decode`` on a built-in multilingual corpus, every added token and random id sequences. When the
decoder cannot be expressed as a table (WordPiece ``##``, ``clean_up_tokenization_spaces``, an unknown
decoder, or a failed verification), it uses :class:`RedecodeDetokenizer`, an exact but slower fallback.
Which path is used is logged and exposed as ``decode_path``.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from proxy import hotpath
from proxy.decode_table import (
    VERIFY_CORPUS,
    Detokenizer,
    RedecodeDetokenizer,
    build_decode_table,
    bytes_to_unicode,
    verify_decode_table,
)
from proxy.decode_table import skipped_special_ids as _find_skipped_ids
from proxy.errors import InvalidRequestError

__all__ = [
    "VERIFY_CORPUS",
    "Detokenizer",
    "RedecodeDetokenizer",
    "Tokenizer",
    "build_decode_table",
    "bytes_to_unicode",
    "find_eos_token_ids",
    "verify_decode_table",
]

logger = logging.getLogger(__name__)


_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


def find_eos_token_ids(hf_tokenizer: Any, generation_eos_ids: Iterable[int] = ()) -> frozenset[int]:
    """The ids that end a generation: THE end-of-sequence rule (everything else reads its result).

    The union of (1) ``generation_eos_ids``, the model's generation config / config
    ``eos_token_id`` (int or list); (2) the tokenizer's ``eos_token_id``; (3) the end-of-turn
    tokens of chat templates (``<|im_end|>``, ``<|eot_id|>``, ``<|end|>``, ``<end_of_turn>``,
    ``<|endoftext|>``) that this tokenizer has as special tokens. (3) matters because many chat
    models name only ``<|endoftext|>`` in their config while their template ends each turn with
    ``<|im_end|>``; vLLM and transformers' ``generate`` read the generation config the same way.
    In a harmony vocabulary (GPT-OSS: ``<|channel|>`` is a special token) ``<|end|>`` ends one
    message, not the turn (the answer follows the reasoning message), so (3) leaves it out; its turn
    ends with ``<|return|>`` or ``<|call|>``, from (1) and (2).
    """
    hf = hf_tokenizer
    ids: set[int] = {int(i) for i in generation_eos_ids}
    eos = getattr(hf, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(i) for i in eos)
    vocab = hf.get_vocab()
    special = set(getattr(hf, "all_special_ids", []) or [])
    backend = getattr(hf, "_tokenizer", None)
    if backend is not None:
        special.update(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
    harmony = vocab.get("<|channel|>") in special
    for token in _END_OF_TURN_TOKENS:
        if harmony and token == "<|end|>":
            continue
        i = vocab.get(token)
        if i is not None and i in special:
            ids.add(i)
    return frozenset(ids)


class Tokenizer:
    """The model's tokenizer as the server uses it.

    Args:
        hf_tokenizer: a transformers tokenizer (fast tokenizers get the table path).
        verify: verify the decode table at build time (default True; the fallback is used on a mismatch).
        generation_eos_ids: the model's own EOS ids (generation config / config ``eos_token_id``).

    Attributes:
        decode_table: the verified :class:`proxy.hotpath.DecodeTable`, or None on the fallback path.
        decode_path: ``"table: <kind>"`` or ``"fallback: <reason>"`` (also logged at construction).
        eos_token_ids: the ids that end a generation, :func:`find_eos_token_ids` (the engine uses
            exactly these).
    """

    def __init__(
        self, hf_tokenizer: Any, *, verify: bool = True, generation_eos_ids: Iterable[int] = ()
    ) -> None:
        self.hf_tokenizer = hf_tokenizer
        table, description = build_decode_table(hf_tokenizer)
        if table is not None and verify:
            mismatch, checked = verify_decode_table(hf_tokenizer, table)
            if mismatch is not None:
                logger.warning("decode table failed verification (%s): %s", description, mismatch)
                table, description = None, f"table verification failed ({description})"
            else:
                description = f"{description}, verified on {checked} sequences"
        self.decode_table = table
        if table is not None:
            self.decode_path = f"table: {description}"
            logger.info("detokenizer path: %s (compiled=%s)", self.decode_path, hotpath.IS_COMPILED)
        else:
            self.decode_path = f"fallback: {description}"
            logger.warning("detokenizer path: %s (exact re-decode, slower)", self.decode_path)
        self.eos_token_ids = find_eos_token_ids(hf_tokenizer, generation_eos_ids)
        self._keeping_tables: dict[frozenset[int], hotpath.DecodeTable] = {}
        self._skipped: frozenset[int] | None = None
        self._special_ids_of: dict[tuple[str, ...], frozenset[int]] = {}

    def with_generation_eos(self, generation_eos_ids: Iterable[int]) -> Tokenizer:
        """This tokenizer with the model's EOS ids added (:func:`find_eos_token_ids`'s (1): the same
        ids as ``Tokenizer(hf_tokenizer, generation_eos_ids=...)``): a shallow copy sharing its tables."""
        other = copy.copy(self)
        other.eos_token_ids = self.eos_token_ids | frozenset(int(i) for i in generation_eos_ids)
        return other

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (BOS etc. added per the tokenizer when ``add_special_tokens``)."""
        return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The chat rendered to prompt text by the tokenizer's chat template (``kwargs``: ``tools``,
        ``chat_template_kwargs`` entries such as ``enable_thinking``).

        Raises:
            InvalidRequestError: the tokenizer has no chat template, or the template rejects the messages
                (e.g. a role it does not know, ``raise_exception`` in the template).
        """
        hf = self.hf_tokenizer
        if not getattr(hf, "chat_template", None):
            raise InvalidRequestError(
                "This model has no chat template; use /v1/completions with a plain prompt.", param="messages"
            )
        try:
            text = hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except Exception as exc:
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InvalidRequestError(
                f"The chat template rejected the messages: {detail}", param="messages"
            ) from exc
        if not isinstance(text, str):
            raise InvalidRequestError("The chat template did not render to text.", param="messages")
        return text

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Prompt token ids of a chat: :meth:`render_chat_template`, then encoded without adding specials.

        Raises:
            InvalidRequestError: as :meth:`render_chat_template`.
        """
        text = self.render_chat_template(messages, add_generation_prompt, **kwargs)
        return list(self.hf_tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """``tokenizer.decode(ids, skip_special_tokens=True)``: the non-streamed text."""
        text: str = self.hf_tokenizer.decode(list(ids), skip_special_tokens=True)
        return text

    @property
    def skipped_special_ids(self) -> frozenset[int]:
        """The ids ``decode(..., skip_special_tokens=True)`` drops (what the detokenizer skips)."""
        if self.decode_table is not None:
            return frozenset(self.decode_table.special_ids)
        if self._skipped is None:
            self._skipped = _find_skipped_ids(self.hf_tokenizer)
        return self._skipped

    def special_ids_of(self, texts: Iterable[str]) -> frozenset[int]:
        """The ids of those ``texts`` that are single special tokens the detokenizer skips (e.g.
        Mistral's ``[TOOL_CALLS]``); texts that are not such a token are left out. Cached per
        ``texts`` (``get_vocab()`` builds the whole vocabulary)."""
        key = tuple(texts)
        found = self._special_ids_of.get(key)
        if found is None:
            vocab = self.hf_tokenizer.get_vocab()
            skipped = self.skipped_special_ids
            found = frozenset(i for i in (vocab.get(t) for t in key) if i is not None and i in skipped)
            self._special_ids_of[key] = found
        return found

    def new_detokenizer(self, keep_special_ids: frozenset[int] = frozenset()) -> Detokenizer:
        """A fresh incremental detokenizer for one request (table path or the exact fallback).

        Args:
            keep_special_ids: special tokens whose text is kept (``SamplingParams.keep_special_ids``);
                every other special token is dropped, as ``decode(skip_special_tokens=True)`` does.
        """
        keep = frozenset(keep_special_ids) & self.skipped_special_ids
        if self.decode_table is not None:
            return hotpath.IncrementalDetokenizer(self._table_keeping(keep) if keep else self.decode_table)
        # Hold back possible clean-up rewrites always: decoders (e.g. WordPiece) may clean up on their own.
        if not keep:
            return RedecodeDetokenizer(self.decode, holds_cleanup=True)
        drop = self.skipped_special_ids - keep
        hf = self.hf_tokenizer

        def decode_keeping(ids: list[int]) -> str:
            text: str = hf.decode([i for i in ids if i not in drop], skip_special_tokens=False)
            return text

        return RedecodeDetokenizer(decode_keeping, holds_cleanup=True)

    def _table_keeping(self, keep: frozenset[int]) -> hotpath.DecodeTable:
        """The decode table with ``keep`` decoded as text (built once per set; the token bytes of a
        special token are its text)."""
        table = self._keeping_tables.get(keep)
        if table is None:
            base = self.decode_table
            assert base is not None
            table = hotpath.DecodeTable(list(base.token_bytes), frozenset(base.special_ids) - keep,
                                        base.strip_leading_space, frozenset(base.byte_fallback_ids))
            self._keeping_tables[keep] = table
        return table

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token, for logprobs ``bytes`` (OpenAI): may be part of a UTF-8 character.

        Special tokens give their text; on the fallback path the bytes of ``decode([id])`` are used.
        """
        if self.decode_table is not None:
            tb = self.decode_table.token_bytes
            return tb[token_id] if 0 <= token_id < len(tb) else b""
        text: str = self.hf_tokenizer.decode([token_id], skip_special_tokens=False)
        return text.encode()

    def token_text(self, token_id: int) -> str:
        """Text of one token for logprobs ``token``: its bytes decoded, U+FFFD for partial characters."""
        return self.token_bytes(token_id).decode("utf-8", "replace")
