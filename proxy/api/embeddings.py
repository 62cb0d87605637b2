"""``POST /v1/embeddings`` (OpenAI "Create embeddings"): read, validate, embed, respond.

The schema is :mod:`proxy.protocol.embeddings`; the vectors come from the
:class:`~proxy.engine.client.EmbeddingClient` in ``ServerState`` (its own worker thread, beside
the chat engine). ``model`` must be the embedding model's id (``/v1/models`` lists it): another id
is a 404 ``model_not_found`` naming ``param: "model"``, as the chat routes answer.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from proxy import protocol
from proxy.errors import ModelNotFoundError

from .body import read_json_body
from .state import ServerState


async def create_embeddings(request: Request) -> Response:
    """``POST /v1/embeddings``: one vector per input, in order; ``usage`` counts the tokens embedded.

    Errors: 400 naming the ``param`` (``proxy.protocol.parse_embedding_request`` and
    ``EmbeddingClient.embed``), 404 for another model id, 503 while loading or draining.
    """
    start = time.monotonic()
    state: ServerState = request.app.state.server
    body = await read_json_body(request, state.settings.max_body_bytes)
    embedder = state.require_embedder(request)
    req = protocol.parse_embedding_request(body)
    served = embedder.served_model_name
    if req.model != served:
        raise ModelNotFoundError(f"The model '{req.model}' does not exist; embeddings are served by "
                                 f"'{served}'.",
                                 param="model")
    out = await embedder.embed(req.texts, req.token_ids, truncate_prompt_tokens=req.truncate_prompt_tokens,
                               dimensions=req.dimensions)
    body_out = protocol.embedding_response(out.vectors, served, out.num_prompt_tokens, req.encoding_format)
    client = state.client
    if client is not None:
        client.metrics.observe_embedding(served, num_prompt_tokens=out.num_prompt_tokens,
                                         latency_s=time.monotonic() - start)
    return Response(body_out, media_type="application/json")
