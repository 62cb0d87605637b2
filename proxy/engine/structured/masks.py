"""Token bitmasks in xgrammar's layout: built from allowed ids, applied to logits, and the logits
width they must cover. A mask row is int32 words, bit ``t % 32`` of word ``t // 32`` set when token
``t`` is allowed."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import xgrammar as xgr

from proxy.quant.apply import output_layer

__all__ = ["allow_token", "apply_bitmask", "has_control_char", "logits_width", "token_mask"]

_CONTROL_BYTES = frozenset(range(32))


def has_control_char(raw: bytes) -> bool:
    """True when a token's bytes hold a control character U+0000-U+001F (raw, never valid in JSON text)."""
    return not _CONTROL_BYTES.isdisjoint(raw)


def token_mask(vocab_size: int, allowed_ids: Iterable[int]) -> torch.Tensor:
    """int32 ``[ceil(vocab_size / 32)]`` bitmask (xgrammar's layout) allowing exactly ``allowed_ids``."""
    allowed = torch.zeros(((vocab_size + 31) // 32) * 32, dtype=torch.bool)
    ids = [i for i in allowed_ids if 0 <= i < vocab_size]
    if ids:
        allowed[torch.tensor(ids, dtype=torch.long)] = True
    weights = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int64)
    words = (allowed.view(-1, 32).to(torch.int64) * weights).sum(dim=1)
    return words.to(torch.int32)


def allow_token(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Set token ``token_id``'s bit in ``bitmask[row]`` (int32 words; bit 31 is the sign bit); an id
    outside the mask's columns is ignored."""
    word, bit = divmod(token_id, 32)
    if token_id < 0 or word >= bitmask.shape[1]:
        return
    value = int(bitmask[row, word]) | (1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


def logits_width(model: torch.nn.Module) -> int:
    """Columns of the model's logits (what the masks must cover): the output head's ``out_features``
    (``nn.Linear`` and the quantized ``PackedLinear`` both have it; a packed head has no ``weight``),
    else its weight's rows, else the text config's ``vocab_size``."""
    head = output_layer(model)
    width = getattr(head, "out_features", None)
    if width is None and head is not None and getattr(head, "weight", None) is not None:
        width = head.weight.shape[0]
    if width is None:
        config: Any = model.config
        width = (config.get_text_config() if hasattr(config, "get_text_config") else config).vocab_size
    return int(width)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set the disallowed logits of ``rows`` to ``-inf`` in place.

    Args:
        logits: ``[S, V]`` float logits (CPU or CUDA).
        bitmask: int32 ``[len(rows), ceil(V / 32)]`` on the CPU; row ``k`` is the mask of ``rows[k]``.
        rows: the constrained rows of ``logits``; the others are untouched.

    On the CPU this is xgrammar's CPU kernel; on CUDA the mask is copied to the device and applied
    there by xgrammar's CUDA kernel (``backend="auto"``).
    """
    vocab = logits.shape[-1]
    if len(rows) == logits.shape[0] and list(rows) == list(range(len(rows))):
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device, non_blocking=True), vocab_size=vocab
        )
        return
    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
    full[torch.tensor(list(rows), dtype=torch.long)] = bitmask
    xgr.apply_token_bitmask_inplace(
        logits, full.to(logits.device, non_blocking=True), vocab_size=vocab, indices=list(rows)
    )
