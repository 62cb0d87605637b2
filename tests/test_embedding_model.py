"""Embedding models in-process: pooling configs, vectors against sentence-transformers and plain
transformers, batch invariance, the worker's batching and its 400s (``proxy.models.pooling``,
``proxy.models.embedding``, ``proxy.engine.embedding_worker``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from api.fakes import make_tiny_model
from embedding_fixtures import cosine, make_tiny_bert, st_reference

from proxy.engine.embedding_worker import EmbeddingWorker, batches
from proxy.errors import InvalidRequestError, ServiceUnavailableError
from proxy.models import ModelLoadError
from proxy.models.embedding import load_embedding_model
from proxy.models.pooling import PoolingConfig, read_pooling_config

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "paris is the capital city of france",
         "rain"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embedders")
    return {
        "mean": make_tiny_bert(root / "mean"),
        "cls": make_tiny_bert(root / "cls", pooling="cls", normalize=False, legacy=False),
        "last": make_tiny_bert(root / "last", pooling="lasttoken", max_seq_length=None),
    }


@pytest.mark.parametrize(("name", "want"), [
    ("mean", PoolingConfig("mean", True, 48)),
    ("cls", PoolingConfig("cls", False, 48)),
    ("last", PoolingConfig("last", True, None)),
])
def test_pooling_config_is_read_from_modules_json(folders, name, want):
    assert read_pooling_config(folders[name]) == want


def test_folder_without_modules_json_has_no_pooling_config(tmp_path):
    assert read_pooling_config(make_tiny_model(tmp_path / "llama")) is None


@pytest.mark.parametrize("change", ["max_pooling", "two_modes", "dense_module"])
def test_unserved_sentence_transformer_parts_are_refused(tmp_path, change):
    folder = make_tiny_bert(tmp_path / "m")
    pooling = folder / "1_Pooling" / "config.json"
    if change == "max_pooling":
        pooling.write_text(json.dumps({"pooling_mode": "max"}))
    elif change == "two_modes":
        pooling.write_text(json.dumps({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}))
    else:
        mods = json.loads((folder / "modules.json").read_text())
        mods.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
        (folder / "modules.json").write_text(json.dumps(mods))
    with pytest.raises(ModelLoadError):
        read_pooling_config(folder)


@pytest.mark.parametrize("name", ["mean", "cls", "last"])
def test_vectors_equal_sentence_transformers(folders, name):
    model = load_embedding_model(folders[name], CPU, torch.float32)
    got = model.embed(model.tokenize(TEXTS)).numpy()
    ref = st_reference(folders[name], TEXTS)
    assert got.shape == ref.shape == (len(TEXTS), 32)
    for a, b in zip(got, ref):
        assert cosine(a, b) > 1 - 1e-5
    np.testing.assert_allclose(got, ref, atol=1e-5)
    norms = np.linalg.norm(got, axis=1)
    assert np.allclose(norms, 1.0, atol=1e-5) is model.pooling.normalize


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_decoder_pooling_equals_plain_transformers(tmp_path, pooling):
    from transformers import AutoModel

    folder = make_tiny_model(tmp_path / "llama")
    model = load_embedding_model(folder, CPU, torch.float32, default_pooling=pooling)
    ids = model.tokenize(["Hello world! This is a test", "The quick brown fox"])
    got = model.embed(ids).numpy()
    base = AutoModel.from_pretrained(str(folder)).eval()
    for row, seq in zip(got, ids):
        with torch.no_grad():
            states = base(input_ids=torch.tensor([seq])).last_hidden_state[0]
        ref = states[-1] if pooling == "last" else states.mean(0)
        ref = torch.nn.functional.normalize(ref, dim=-1).numpy()
        assert cosine(row, ref) > 1 - 1e-5
        np.testing.assert_allclose(row, ref, atol=1e-5)


def test_batched_equals_one_at_a_time(folders):
    model = load_embedding_model(folders["mean"], CPU, torch.float32)
    ids = model.tokenize(TEXTS)
    batched = model.embed(ids).numpy()
    for row, seq in zip(batched, ids):
        np.testing.assert_allclose(row, model.embed([seq]).numpy()[0], atol=1e-6)


def test_batches_group_sorted_lengths_under_the_padded_budget():
    assert batches([5, 1, 3, 3, 9], 9) == [[1, 2, 3], [0], [4]]
    assert batches([20], 8) == [[0]]  # one input alone may exceed the budget
    assert batches([2, 2, 2, 2], 8) == [[0, 1, 2, 3]]


def _worker(folder: Path, **kw) -> EmbeddingWorker:
    worker = EmbeddingWorker(lambda: load_embedding_model(folder, CPU, torch.float32), "tiny", **kw)
    worker.start()
    return worker


def test_worker_batches_requests_and_checks_inputs(folders):
    worker = _worker(folders["mean"], max_num_batched_tokens=16)
    try:
        model = worker.model
        assert model is not None and worker.max_model_len == 48

        async def run():
            return await asyncio.gather(*(worker.embed([t], None) for t in TEXTS), worker.embed(TEXTS, None))

        *singles, together = asyncio.run(run())
        ref = model.embed(model.tokenize(TEXTS)).numpy()
        np.testing.assert_allclose(together.vectors, ref, atol=1e-6)
        np.testing.assert_allclose(np.concatenate([s.vectors for s in singles]), ref, atol=1e-6)
        assert together.num_prompt_tokens == sum(len(x) for x in model.tokenize(TEXTS))

        small = asyncio.run(worker.embed(TEXTS, None, dimensions=8)).vectors
        assert small.shape == (4, 8)
        np.testing.assert_allclose(np.linalg.norm(small, axis=1), 1.0, atol=1e-6)
        head = ref[:, :8]
        np.testing.assert_allclose(small, head / np.linalg.norm(head, axis=1, keepdims=True), atol=1e-6)

        long_text = " ".join(["fox"] * 60)
        with pytest.raises(InvalidRequestError) as err:
            asyncio.run(worker.embed(["rain", long_text], None))
        assert err.value.param == "input[1]" and "62 tokens" in err.value.message
        cut = asyncio.run(worker.embed([long_text], None, truncate_prompt_tokens=-1))
        assert cut.num_prompt_tokens == 48
        ids = asyncio.run(worker.embed(None, [[5] * 100], truncate_prompt_tokens=10))
        assert ids.num_prompt_tokens == 10
        for kw, param in [({"dimensions": 33}, "dimensions"),
                          ({"truncate_prompt_tokens": 49}, "truncate_prompt_tokens")]:
            with pytest.raises(InvalidRequestError) as err:
                asyncio.run(worker.embed(["rain"], None, **kw))
            assert err.value.param == param
        with pytest.raises(InvalidRequestError) as err:
            asyncio.run(worker.embed(None, [[1, 2], [2, model.vocab_size]]))
        assert err.value.param == "input[1]"
    finally:
        worker.shutdown()


def test_a_budget_of_one_token_embeds_every_input_alone(folders):
    """``--embedding-max-num-batched-tokens 1``: every forward pass holds one input, so a text's
    vector is the same bits alone and inside a request of three (docs/embeddings.md)."""
    worker = _worker(folders["mean"], max_num_batched_tokens=1)
    try:
        model = worker.model
        assert model is not None
        sizes: list[int] = []
        embed = model.embed

        def counted(batch):
            sizes.append(len(batch))
            return embed(batch)

        model.embed = counted  # type: ignore[method-assign]
        alone = asyncio.run(worker.embed([TEXTS[1]], None)).vectors
        three = asyncio.run(worker.embed(TEXTS[:3], None)).vectors
        assert sizes == [1, 1, 1, 1]
        assert np.array_equal(three[1], alone[0])
    finally:
        worker.shutdown()


def test_lazy_worker_reports_a_failed_load_as_503():
    def fail():
        raise ModelLoadError("no such folder")

    worker = EmbeddingWorker(fail, "x", lazy=True)
    worker.start()  # lazy: nothing loaded yet, no error
    try:
        for _ in range(2):
            with pytest.raises(ServiceUnavailableError, match="no such folder"):
                asyncio.run(worker.embed(["a"], None))
    finally:
        worker.shutdown()


@pytest.mark.parametrize("field", [{"embedding_pooling": "max"}, {"embedding_max_num_batched_tokens": 0},
                                   {"embedding_num_threads": 0}])
def test_settings_refuse_unserved_embedding_knobs(field):
    from proxy.settings import Settings

    with pytest.raises(ValueError, match="embedding"):
        Settings(**field)
