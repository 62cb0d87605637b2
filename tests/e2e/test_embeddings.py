"""``POST /v1/embeddings`` against a real uvicorn: a tiny random BERT sentence-transformer as
``--embedding-model`` beside a tiny chat model, driven by the OpenAI SDK, LangChain and LlamaIndex;
vectors equal sentence-transformers' on the same folder; bad bodies are 400s naming the ``param``."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from api.fakes import make_tiny_model
from embedding_fixtures import cosine, make_tiny_bert, st_reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.ports import start_serve

NAME = "tiny-bert"
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "paris is the capital city of france",
         "rain", "search query answer"]


@dataclass
class EmbedServer:
    base_url: str
    folder: Path
    reference: np.ndarray  # sentence-transformers' vectors of TEXTS


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbedServer]:
    root = tmp_path_factory.mktemp("embed-e2e")
    chat, bert = make_tiny_model(root / "tiny-llama"), make_tiny_bert(root / "bert")
    srv = start_serve(["--model", str(chat), "--num-threads", "1", "--max-model-len", "256",
                       "--num-kv-blocks", "64", "--dtype", "float32", "--no-engine-process",
                       "--embedding-model", str(bert), "--served-embedding-model-name", NAME,
                       "--embedding-max-num-batched-tokens", "32", "--no-self-check"],
                      root / "server.log", timeout_s=300)
    try:
        yield EmbedServer(srv.base_url, bert, st_reference(bert, TEXTS))
    finally:
        srv.stop(30.0)


def _num_tokens(folder: Path, texts: list[str]) -> int:
    from transformers import AutoTokenizer

    return sum(len(ids) for ids in AutoTokenizer.from_pretrained(str(folder))(texts)["input_ids"])


def _post(server: EmbedServer, body: object) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/embeddings", json=body, timeout=60)


def test_models_lists_the_embedding_model(embed_server):
    ids = [m["id"] for m in httpx.get(f"{embed_server.base_url}/v1/models", timeout=10).json()["data"]]
    assert ids == ["tiny-llama", NAME]
    card = httpx.get(f"{embed_server.base_url}/v1/models/{NAME}", timeout=10).json()
    assert card["id"] == NAME and card["object"] == "model"
    assert httpx.get(f"{embed_server.base_url}/v1/models/nope", timeout=10).status_code == 404


@pytest.mark.parametrize("encoding_format", ["float", "sdk-default"])
def test_openai_sdk_vectors_equal_sentence_transformers(embed_server, encoding_format):
    """The SDK sends ``encoding_format: "base64"`` when none is given and decodes the vectors itself."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{embed_server.base_url}/v1", api_key="unused")
    kwargs = {"encoding_format": "float"} if encoding_format == "float" else {}
    resp = client.embeddings.create(model=NAME, input=TEXTS, **kwargs)
    assert [d.index for d in resp.data] == list(range(len(TEXTS))) and resp.model == NAME
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == _num_tokens(embed_server.folder, TEXTS)
    for d, ref in zip(resp.data, embed_server.reference):
        assert len(d.embedding) == 32 and cosine(d.embedding, ref) > 1 - 1e-5
    one = client.embeddings.create(model=NAME, input=TEXTS[1], **kwargs)
    np.testing.assert_allclose(one.data[0].embedding, resp.data[1].embedding, atol=1e-6)


def test_base64_is_little_endian_float32(embed_server):
    floats = _post(embed_server, {"model": NAME, "input": TEXTS[:2]}).json()["data"]
    packed = _post(embed_server, {"model": NAME, "input": TEXTS[:2], "encoding_format": "base64"})
    packed = packed.json()["data"]
    for f, p in zip(floats, packed):
        # the float form writes each float32 as its shortest decimal: equal once read back as float32
        assert np.array_equal(np.frombuffer(base64.b64decode(p["embedding"]), dtype="<f4"),
                              np.array(f["embedding"], dtype=np.float32))


def test_batched_equals_one_at_a_time_and_token_ids(embed_server):
    batched = _post(embed_server, {"model": NAME, "input": TEXTS}).json()["data"]
    for text, row in zip(TEXTS, batched):
        alone = _post(embed_server, {"model": NAME, "input": text}).json()["data"][0]["embedding"]
        np.testing.assert_allclose(alone, row["embedding"], atol=1e-6)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(embed_server.folder))(TEXTS[:2])["input_ids"]
    by_ids = _post(embed_server, {"model": NAME, "input": ids}).json()
    assert by_ids["usage"]["prompt_tokens"] == sum(map(len, ids))
    for got, row in zip(by_ids["data"], batched):
        np.testing.assert_allclose(got["embedding"], row["embedding"], atol=1e-6)


def test_dimensions_truncate_and_renormalise(embed_server):
    body = _post(embed_server, {"model": NAME, "input": TEXTS, "dimensions": 8}).json()
    for d, ref in zip(body["data"], embed_server.reference):
        vec = np.array(d["embedding"])
        assert vec.shape == (8,) and abs(np.linalg.norm(vec) - 1) < 1e-6
        assert cosine(vec, ref[:8]) > 1 - 1e-5


def test_langchain_embed_query_and_documents(embed_server):
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: otherwise LangChain splits texts with tiktoken (OpenAI's own
    # vocabulary, downloaded at first use) and sends those token ids, which are no ids of this model.
    emb = OpenAIEmbeddings(base_url=f"{embed_server.base_url}/v1", api_key="unused", model=NAME,
                           check_embedding_ctx_length=False)
    query = emb.embed_query(TEXTS[0])
    docs = emb.embed_documents(TEXTS)
    assert cosine(query, embed_server.reference[0]) > 1 - 1e-5
    for got, ref in zip(docs, embed_server.reference):
        assert cosine(got, ref) > 1 - 1e-5


def test_llama_index_openai_embedding(embed_server):
    pytest.importorskip("llama_index.embeddings.openai")
    from llama_index.embeddings.openai import OpenAIEmbedding

    emb = OpenAIEmbedding(model_name=NAME, api_base=f"{embed_server.base_url}/v1", api_key="unused")
    assert cosine(emb.get_query_embedding(TEXTS[1]), embed_server.reference[1]) > 1 - 1e-5
    for got, ref in zip(emb.get_text_embedding_batch(TEXTS), embed_server.reference):
        assert cosine(got, ref) > 1 - 1e-5


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": NAME, "input": ""}, 400, "input"),
    ({"model": NAME, "input": []}, 400, "input"),
    ({"model": NAME, "input": ["a", [1]]}, 400, "input[1]"),
    ({"model": NAME, "input": ["rain", " ".join(["fox"] * 60)]}, 400, "input[1]"),
    ({"model": NAME, "input": [[1], [99999]]}, 400, "input[1]"),
    ({"model": NAME, "input": "a", "dimensions": 0}, 400, "dimensions"),
    ({"model": NAME, "input": "a", "dimensions": 33}, 400, "dimensions"),
    ({"model": NAME, "input": "a", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"model": "tiny-llama", "input": "a"}, 404, "model"),
])
def test_bad_input_names_the_param(embed_server, body, status, param):
    resp = _post(embed_server, body)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param


def test_truncate_prompt_tokens(embed_server):
    body = _post(embed_server, {"model": NAME, "input": " ".join(["fox"] * 60), "truncate_prompt_tokens": 10})
    assert body.status_code == 200 and body.json()["usage"]["prompt_tokens"] == 10


_scalar = (st.none() | st.booleans() | st.integers(-3, 70000)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8))
_json = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=4), max_leaves=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.fixed_dictionaries({}, optional={"model": st.sampled_from([NAME, "other", 3]), "input": _json,
                                           "encoding_format": _json, "dimensions": _json,
                                           "truncate_prompt_tokens": _json, "user": _json}))
def test_fuzzed_bodies_never_give_a_5xx(embed_server, body):
    resp = _post(embed_server, body)
    assert resp.status_code < 500, (body, resp.text)
    if resp.status_code != 200:
        assert resp.json()["error"]["type"] == "invalid_request_error"


def test_metrics_count_embedding_requests(embed_server):
    _post(embed_server, {"model": NAME, "input": ["hello world", "rain"]})
    text = httpx.get(f"{embed_server.base_url}/metrics", timeout=10).text
    for name in ("streamproxy:embedding_requests_total", "streamproxy:embedding_prompt_tokens_total",
                 "streamproxy:embedding_request_latency_seconds_count"):
        line = next(x for x in text.splitlines() if x.startswith(f'{name}{{model_name="{NAME}"}}'))
        assert float(line.split()[-1]) >= 1
