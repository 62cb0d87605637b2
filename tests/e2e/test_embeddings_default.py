"""``/v1/embeddings`` on the default model embedding itself (``--embedding-pooling last``), in both
engine modes: the embedding worker runs in the server process whether the chat engine is a thread
or a child process."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from embedding_fixtures import cosine

from .server import Server

pytestmark = pytest.mark.slow

TEXTS = ["Paris is the capital of France.", "A fox jumps over the dog.", "Rain falls on the river."]


def test_default_model_embeds_itself(server: Server):
    from langchain_openai import OpenAIEmbeddings
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    floats = client.embeddings.create(model=server.model, input=TEXTS, encoding_format="float")
    packed = client.embeddings.create(model=server.model, input=TEXTS)  # the SDK asks for base64
    assert floats.model == server.model and floats.usage.prompt_tokens > len(TEXTS)
    vectors = np.array([d.embedding for d in floats.data])
    assert vectors.shape == (3, 576)  # SmolLM2-135M's hidden size
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(np.array([d.embedding for d in packed.data]), vectors, atol=1e-6)
    for text, row in zip(TEXTS, vectors):  # one at a time: same vectors up to the dtype's rounding
        alone = client.embeddings.create(model=server.model, input=text, encoding_format="float")
        assert cosine(alone.data[0].embedding, row) > 0.999
    small = client.embeddings.create(model=server.model, input=TEXTS, dimensions=64, encoding_format="float")
    for d, row in zip(small.data, vectors):
        assert len(d.embedding) == 64 and abs(np.linalg.norm(d.embedding) - 1) < 1e-5
        assert cosine(d.embedding, row[:64]) > 1 - 1e-5
    docs = OpenAIEmbeddings(base_url=f"{server.base_url}/v1", api_key="unused", model=server.model,
                            check_embedding_ctx_length=False).embed_documents(TEXTS)
    for got, row in zip(docs, vectors):
        assert cosine(got, row) > 0.999
    ids = [m["id"] for m in httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"]]
    assert ids == [server.model]  # the same id serves both
