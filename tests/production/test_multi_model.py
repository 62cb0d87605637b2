"""Several real models in one server (issue 48's "done when"): two tiny Llamas with ``--models-max 1``,
alternated A, B, A, each answering exactly its greedy text as when served alone; a model that cannot
be served exits the one-model server non-zero with a one-line reason; each published router in front
of a several-model replica routes A and B to it (the replica picks the engine by ``model``), and in
front of replicas with different model lists sends requests to a replica that lacks the model."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from api.fakes import make_hf_tokenizer, make_tiny_model
from api.real_app import real_app

from proxy.api.app import create_app
from proxy.engine.model_files import MODEL_FILES
from proxy.settings import Settings

from .helpers import REPO, start_server
from .test_routers import ROUTERS, router

ENGINE = {"max_model_len": 256, "num_kv_blocks": 64, "num_threads": 1, "device": "cpu", "dtype": "float32"}
ENGINE_ARGS = ["--max-model-len", "256", "--num-kv-blocks", "64", "--num-threads", "1", "--device", "cpu",
               "--dtype", "float32"]
ASK = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("two")
    return make_tiny_model(root / "llama-a", seed=0), make_tiny_model(root / "llama-b", seed=1)


async def _alone(folder: Path, name: str) -> str:
    settings = Settings(model=str(folder), served_model_name=name, engine_process=False, **ENGINE)
    async with real_app(settings) as (client, _):
        reply = await client.post("/v1/chat/completions", json={"model": name, **ASK})
        text: str = reply.json()["choices"][0]["message"]["content"]
        return text


async def _alternate(a: Path, b: Path) -> tuple[list[str], list[Any], list[int], list[bool], list[Any], Any]:
    settings = Settings(model=str(a), served_model_name="A", extra_models=(f"{b}=B",), models_max=1, **ENGINE)
    app = create_app(settings)
    texts, seen, pids, alive, nices, tokenizers, reads = [], [], [], [], [], [], [MODEL_FILES.num_reads]
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://t",
                                                                   timeout=300) as client:
        for name in ("A", "B", "A"):
            reply = await client.post("/v1/chat/completions", json={"model": name, **ASK})
            texts.append(reply.json()["choices"][0]["message"]["content"])
            models = (await client.get("/v1/models")).json()["data"]
            seen.append({m["id"]: m["status"]["value"] for m in models})
            engine = app.state.server.registry.find(name).client
            core = engine.core
            pids.append(core.pid)  # its engine process
            nices.append((core.info.load_nice, core.info.serve_nice))
            alive.append([Path(f"/proc/{pid}").exists() for pid in pids])
            tokenizers.append(engine.tokenizer.hf_tokenizer)
            reads.append(MODEL_FILES.num_reads)
    kept = {os.path.realpath(a), os.path.realpath(b)} <= set(MODEL_FILES.kept())
    files = (kept, reads[1] - reads[0] <= 2, reads[3] - reads[1], tokenizers[0] is tokenizers[2])
    return texts, seen, pids, alive, nices, files


@pytest.mark.slow
def test_two_models_alternate_under_models_max_1(two_models: tuple[Path, Path]) -> None:
    a, b = two_models
    alone_a, alone_b = asyncio.run(_alone(a, "A")), asyncio.run(_alone(b, "B"))
    assert alone_a != alone_b  # two different models, or the test could not tell them apart
    texts, seen, pids, alive, nices, files = asyncio.run(_alternate(a, b))  # each engine in its own process
    assert texts == [alone_a, alone_b, alone_a]
    start = os.nice(0)  # each load ran with no other model loaded (--models-max 1): nothing to yield to
    assert nices == [(start, start)] * 3
    assert len(set(pids)) == 3  # a fresh process each load; an unloaded model's has exited (memory freed)
    assert alive == [[True], [False, True], [False, False, True]]
    assert seen == [{"A": "loaded", "B": "unloaded"}, {"A": "unloaded", "B": "loaded"},
                    {"A": "loaded", "B": "unloaded"}]
    # both tokenizers were read (once each) before the first model served, none by a later load, and
    # A's second load reuses the tokenizer its first had (proxy.engine.model_files)
    assert files == (True, True, 0, True)


def test_a_model_that_cannot_be_served_exits_with_one_line(tmp_path: Path) -> None:
    from transformers import PaliGemmaConfig

    folder = tmp_path / "paligemma"
    PaliGemmaConfig().save_pretrained(folder)
    make_hf_tokenizer().save_pretrained(folder)
    done = subprocess.run([sys.executable, "-m", "proxy", "serve", "--model", str(folder), "--port", "0",
                           "--device", "cpu"], check=False, cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    reason = ("ModelLoadError: model type 'paligemma' is a vision-language model that streamproxy does not "
              "serve yet (served with images: gemma3, idefics3, llava, llava_next, llava_onevision, "
              "mistral3, qwen2_5_vl, qwen2_vl, qwen3_vl, qwen3_vl_moe, smolvlm)")
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1].startswith(f"streamproxy: the model cannot be served: {reason}")
    assert "Traceback" not in done.stderr and str(folder) not in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("kind", ROUTERS)
def test_a_router_in_front_of_a_several_model_replica_routes_by_model(
        kind: str, two_models: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = two_models
    replica = start_server(tmp_path, ["--model", f"{a}=A", "--model", f"{b}=B", "--no-engine-process",
                                      *ENGINE_ARGS], name="replica", new_session=True)
    try:
        direct = {m: httpx.post(f"{replica.base_url}/v1/chat/completions", json={"model": m, **ASK},
                                timeout=120).json()["choices"][0]["message"]["content"] for m in ("A", "B")}
        assert direct["A"] != direct["B"]
        with router(tmp_path, kind, [replica]) as base:
            for m in ("A", "B", "A"):
                reply = httpx.post(f"{base}/v1/chat/completions", json={"model": m, **ASK},
                                   timeout=120).json()
                assert (reply["model"], reply["choices"][0]["message"]["content"]) == (m, direct[m])
    finally:
        replica.stop()


async def _chat_and_embed(file: Path) -> tuple[str, list[list[float]], dict[str, Any]]:
    app = create_app(Settings(models_file=str(file), engine_process=False, **ENGINE))
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://t",
                                                                   timeout=300) as client:
        chat = (await client.post("/v1/chat/completions", json={"model": "chat", **ASK})).json()
        embedded = (await client.post("/v1/embeddings",
                                      json={"model": "search", "input": EMBED_TEXTS})).json()
        states = {m["id"]: m["status"]["value"] for m in (await client.get("/v1/models")).json()["data"]}
    return chat["choices"][0]["message"]["content"], [d["embedding"] for d in embedded["data"]], states


EMBED_TEXTS = ["the quick brown fox", "a lazy dog sleeps"]


@pytest.mark.slow
def test_a_models_file_serves_a_chat_model_and_an_embedding_model(two_models: tuple[Path, Path],
                                                                   tmp_path: Path) -> None:
    from embedding_fixtures import cosine, make_tiny_bert, st_reference

    bert = make_tiny_bert(tmp_path / "bert")
    file = tmp_path / "models.toml"
    file.write_text(f'[models.chat]\npath = "{two_models[0]}"\n'
                    f'[models.embed]\npath = "{bert}"\nkind = "embedding"\naliases = ["search"]\n')
    text, vectors, states = asyncio.run(_chat_and_embed(file))
    assert text == asyncio.run(_alone(two_models[0], "chat"))
    reference = st_reference(bert, EMBED_TEXTS)
    assert [len(v) for v in vectors] == [32, 32]
    assert all(cosine(v, r) > 1 - 1e-5 for v, r in zip(vectors, reference, strict=True))
    assert states == {"chat": "loaded", "embed": "loaded"}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ROUTERS)
def test_replicas_serving_different_model_lists_get_requests_for_models_they_lack(
        kind: str, two_models: tuple[Path, Path], tmp_path: Path) -> None:
    """Why docs/scaling.md asks for one model list on every replica: neither router routes by model
    (``sglang-router`` registers a several-model replica as ``unknown``; ``vllm-router`` forwards
    ``/v1/models`` to one replica), so round-robin sends every other request for a model only the
    first replica serves to the second, which answers 404 ``model_not_found``."""
    a, b = two_models
    first = start_server(tmp_path, ["--model", f"{a}=A", "--model", f"{b}=B", "--no-engine-process",
                                    *ENGINE_ARGS], name="first", new_session=True)
    second = start_server(tmp_path, ["--model", f"{b}=B", "--no-engine-process", *ENGINE_ARGS],
                          name="second", new_session=True)
    try:
        with router(tmp_path, kind, [first, second], policy="round_robin") as base:
            def ask(model: str) -> tuple[int, str]:
                reply = httpx.post(f"{base}/v1/chat/completions", json={"model": model, **ASK}, timeout=120)
                return reply.status_code, reply.json().get("error", {}).get("code", "")

            only_first, both = sorted(ask("A") for _ in range(4)), [ask("B") for _ in range(2)]
    finally:
        first.stop()
        second.stop()
    assert only_first == [(200, ""), (200, ""), (404, "model_not_found"), (404, "model_not_found")]
    assert both == [(200, ""), (200, "")]
