"""What the API sees of the embedding model: the :class:`EmbeddingClient` protocol and its
:class:`EmbeddingOutput` (``POST /v1/embeddings``).

``proxy.engine.embedding_worker.EmbeddingWorker`` implements it on its own thread, beside the chat
engine (thread or process), so it works the same in both engine modes; ``proxy.engine.factory.
build_embedding_client`` builds it. Why its own worker and not the engine's step loop:
``docs/embeddings.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class EmbeddingOutput:
    """The vectors of one request.

    Attributes:
        vectors: ``[num_inputs, dimensions]`` float32, in input order (truncated to ``dimensions``
            and re-normalised when asked).
        num_prompt_tokens: tokens embedded over all inputs (after truncation).
    """

    vectors: np.ndarray
    num_prompt_tokens: int


@runtime_checkable
class EmbeddingClient(Protocol):
    """What the API uses of the embedding model.

    Attributes:
        served_model_name: the id clients send as ``model``.
        created: Unix seconds, for ``/v1/models``.
    """

    served_model_name: str
    created: int

    @property
    def max_model_len(self) -> int | None:
        """Most tokens an input may have; None until a lazily loaded model is loaded."""

    async def embed(self, texts: Sequence[str] | None, token_ids: Sequence[Sequence[int]] | None, *,
                    truncate_prompt_tokens: int | None = None,
                    dimensions: int | None = None) -> EmbeddingOutput:
        """Embed the inputs (exactly one of ``texts`` / ``token_ids`` is given).

        Raises:
            InvalidRequestError: an input over the model's length (``param`` ``input[i]``), a token id
                outside the vocabulary, ``dimensions`` above the model's width,
                ``truncate_prompt_tokens`` above the model's length.
            ServiceUnavailableError: the model could not be loaded, or the worker has stopped.
            EngineError: the forward pass failed.
        """

    def shutdown(self) -> None:
        """Stop the worker (queued requests get 503)."""
