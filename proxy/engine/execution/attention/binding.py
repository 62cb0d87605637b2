"""How transformers' layers reach the paged attention: its registered name, the metadata keyword.

transformers calls the function registered under :data:`ATTN_IMPLEMENTATION` (``AttentionInterface``)
in every layer of a model loaded with that ``attn_implementation``; the step's metadata reaches it as
the keyword :data:`METADATA_KWARG` of ``model(...)``. For decoder layers that do not pass keyword
arguments on to their attention (StableLM), the model runner also publishes the metadata for the
duration of the forward pass (:func:`active_metadata`), so the function finds it either way
(:func:`current_metadata`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

ATTN_IMPLEMENTATION = "streamproxy_paged"
"""The name our attention function is registered under in transformers' ``AttentionInterface``."""

METADATA_KWARG = "paged_attn_metadata"
"""The keyword of ``model(...)`` that carries the step's :class:`PagedAttentionMetadata`."""

_ACTIVE = threading.local()


@contextmanager
def active_metadata(meta: Any) -> Iterator[None]:
    """Publish ``meta`` to :func:`paged_attention_forward` calls of this thread while the block runs.

    For decoder layers that drop the keyword arguments of ``model(...)`` before calling their
    attention (transformers' StableLM). Outside the block the function still refuses to run.
    """
    previous = getattr(_ACTIVE, "meta", None)
    _ACTIVE.meta = meta
    try:
        yield
    finally:
        _ACTIVE.meta = previous


def current_metadata(kwargs: dict[str, Any]) -> Any:
    """The step's metadata: the :data:`METADATA_KWARG` keyword of ``kwargs``, else the one
    published by :func:`active_metadata` on this thread, else None."""
    meta = kwargs.get(METADATA_KWARG)
    if meta is None:
        meta = getattr(_ACTIVE, "meta", None)
    return meta
