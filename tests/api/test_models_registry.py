"""Several models in one server (``proxy.api.registry``, ``on_demand``, ``multi``) over scripted engines in a
real uvicorn: routing by ``model``, load on demand (once), ``--models-max``, ``--model-ttl-s``, explicit
load / unload, a failed load, keep-alive comments while a stream waits for its model, metrics per model."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from proxy.api.app import create_app
from proxy.settings import Settings

from .fakes import FakeEngine, fake_client, make_hf_tokenizer, make_tokenizer, post_stream


@dataclass
class Farm:
    """The fake engines' side: every load, each model's gate (a load waits on it) and failure."""

    loads: list[str] = field(default_factory=list)
    shut: list[str] = field(default_factory=list)
    gates: dict[str, threading.Event] = field(default_factory=dict)
    fail: dict[str, str] = field(default_factory=dict)
    engines: dict[str, FakeEngine] = field(default_factory=dict)
    step_s: float = 0.0

    def factory(self, s: Settings) -> Any:
        name = s.served_model_name or ""
        self.loads.append(name)
        gate = self.gates.get(name)
        if gate is not None:
            assert gate.wait(30)
        if name in self.fail:
            raise ValueError(self.fail[name])
        tok = make_tokenizer()
        eos = make_hf_tokenizer().convert_tokens_to_ids("<|im_end|>")
        engine = FakeEngine(reply_ids=list(tok.encode(f"I am {name}.")) + [eos], step_s=self.step_s)
        farm = self

        class Tracked(FakeEngine):
            def shutdown(self) -> None:
                farm.shut.append(name)
                super().shutdown()

        engine.__class__ = Tracked
        self.engines[name] = engine
        return fake_client(engine, name, 256, vocab_size=len(make_hf_tokenizer()))


class FakeEmbedder:
    """Embeds every input as ``[len(text), 1.0]`` (the text's length in characters)."""

    def __init__(self, name: str) -> None:
        self.served_model_name, self.created, self.max_model_len = name, 0, 256

    async def embed(self, texts: Any, token_ids: Any, **kw: Any) -> Any:
        import numpy as np

        from proxy.engine.client.embedding import EmbeddingOutput

        return EmbeddingOutput(np.array([[len(t), 1.0] for t in texts], dtype=np.float32), len(texts))

    def shutdown(self) -> None:
        pass


@contextlib.contextmanager
def multi_server(tmp: Path, names: list[str], farm: Farm, **kw: Any) -> Iterator[httpx.Client]:
    """uvicorn on a thread serving ``names`` (``--model DIR=NAME`` each, scripted engines; none with a
    ``models_file`` in ``kw``)."""
    specs = []
    kw.setdefault("models_memory_bytes", 0)  # the machine's free memory would bound the fakes' 1 GiB pools
    for name in names:
        folder = tmp / name
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"w" * 500)
        specs.append(f"{folder}={name}")
    first = {"model": specs[0].split("=")[0], "served_model_name": names[0]} if specs else {}
    settings = Settings(**first, extra_models=tuple(specs[1:]), **kw)
    app = create_app(settings, farm.factory, embedding_factory=lambda s, m: FakeEmbedder(
        s.served_embedding_model_name or m.served_model_name))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    loop = asyncio.new_event_loop()  # the server's loop, for calls the app takes on it (a drain)
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),), daemon=True)
    thread.start()
    try:
        for _ in range(1000):
            if server.started:
                break
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            client.port = port  # type: ignore[attr-defined]
            client.app, client.loop = app, loop  # type: ignore[attr-defined]
            yield client
    finally:
        for gate in farm.gates.values():
            gate.set()
        server.should_exit = True
        thread.join(15)
        if not thread.is_alive():
            loop.close()


def chat(client: httpx.Client, model: Any, **kw: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], **kw}
    if model is not None:
        body["model"] = model
    return client.post("/v1/chat/completions", json=body)


def states(client: httpx.Client) -> dict[str, Any]:
    return {card["id"]: card["status"] for card in client.get("/v1/models").json()["data"]}


def wait_for(check: Any, limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_requests_route_by_model_and_alias(tmp_path: Path) -> None:
    farm = Farm()
    with multi_server(tmp_path, ["a", "b"], farm) as client:
        assert states(client) == {"a": {"value": "unloaded"}, "b": {"value": "unloaded"}}
        assert client.get("/health").json() == {"status": "ready", "models": [
            {"id": "a", "status": "unloaded"}, {"id": "b", "status": "unloaded"}]}
        first = chat(client, "a").json()
        assert (first["model"], first["choices"][0]["message"]["content"]) == ("a", "I am a.")
        done = client.post("/v1/completions", json={"model": "b", "prompt": "x"}).json()
        assert (done["model"], done["choices"][0]["text"]) == ("b", "I am b.")
        assert states(client) == {"a": {"value": "loaded"}, "b": {"value": "loaded"}}
        assert client.get("/health").json()["models"] == [
            {"id": m, "status": "loaded", "num_running": 0, "num_waiting": 0} for m in ("a", "b")]
        card = client.get("/v1/models/b").json()
        assert (card["id"], card["max_model_len"], card["status"], card["aliases"]) == (
            "b", 256, {"value": "loaded"}, [])
        tokens = client.post("/tokenize", json={"model": "a", "prompt": "hi"}).json()
        assert tokens["tokens"] == make_tokenizer().encode("hi")
        assert farm.loads == ["a", "b"]


def test_missing_and_unknown_model(tmp_path: Path) -> None:
    with multi_server(tmp_path, ["a", "b"], Farm()) as client:
        missing = chat(client, None)
        assert (missing.status_code, missing.json()["error"]["param"]) == (400, "model")
        assert "'model' is required" in missing.json()["error"]["message"]
        unknown = chat(client, "gpt-9")
        assert unknown.status_code == 404
        assert {k: unknown.json()["error"][k] for k in ("type", "param", "code")} == {
            "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
        assert client.get("/v1/models/gpt-9").json()["error"]["code"] == "model_not_found"
        assert client.post("/models/load", json={"model": "gpt-9"}).status_code == 404
        assert client.post("/models/load", json={}).json()["error"]["param"] == "model"
        messages = client.post("/v1/messages", json={"model": "gpt-9", "max_tokens": 5,
                                                     "messages": [{"role": "user", "content": "hi"}]})
        assert (messages.status_code, messages.json()["type"], messages.json()["error"]["type"]) == (
            404, "error", "not_found_error")


def test_concurrent_first_requests_load_once(tmp_path: Path) -> None:
    farm = Farm(gates={"a": threading.Event()})
    with multi_server(tmp_path, ["a", "b"], farm) as client:
        replies: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: replies.append(chat(client, "a"))) for _ in range(4)]
        for t in threads:
            t.start()
        wait_for(lambda: farm.loads == ["a"])
        assert states(client)["a"] == {"value": "loading"}
        assert client.get("/health").status_code == 200
        farm.gates["a"].set()
        for t in threads:
            t.join(30)
        assert [r.json()["choices"][0]["message"]["content"] for r in replies] == ["I am a."] * 4
        assert farm.loads == ["a"]


def test_models_max_unloads_the_least_recently_used(tmp_path: Path) -> None:
    farm = Farm()
    with multi_server(tmp_path, ["a", "b", "c"], farm, models_max=2) as client:
        for model in ("a", "b", "a", "c"):  # c evicts b: a was used after b
            assert chat(client, model).json()["choices"][0]["message"]["content"] == f"I am {model}."
        assert states(client) == {"a": {"value": "loaded"}, "b": {"value": "unloaded"},
                                  "c": {"value": "loaded"}}
        assert (farm.loads, farm.shut) == (["a", "b", "c"], ["b"])


def test_models_max_waits_for_requests_in_flight(tmp_path: Path) -> None:
    farm = Farm(step_s=0.02)
    with multi_server(tmp_path, ["a", "b"], farm, models_max=1) as client:
        chat(client, "a")
        with client.stream("POST", "/v1/chat/completions", json={
                "model": "a", "stream": True, "max_tokens": 200,
                "messages": [{"role": "user", "content": "x"}]}) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            other: list[httpx.Response] = []
            waiter = threading.Thread(target=lambda: other.append(chat(client, "b")))
            waiter.start()
            wait_for(lambda: "b" in states(client) and states(client)["b"]["value"] == "loading")
            assert states(client)["a"] == {"value": "loaded"} and farm.shut == []
            rest = [line for line in lines if line.startswith("data: ")]
        text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                       for line in [first, *rest[:-1]] if json.loads(line[6:])["choices"])
        assert (text, rest[-1]) == ("I am a.", "data: [DONE]")
        waiter.join(30)
        assert other[0].json()["choices"][0]["message"]["content"] == "I am b."
        assert (farm.loads, farm.shut) == (["a", "b"], ["a"])


def test_explicit_load_and_unload_are_idempotent(tmp_path: Path) -> None:
    farm = Farm()
    with multi_server(tmp_path, ["a", "b"], farm) as client:
        for _ in range(2):
            loaded = client.post("/models/load", json={"model": "b"})
            assert (loaded.status_code, loaded.json()) == (
                200, {"success": True, "model": "b", "status": {"value": "loaded"}})
        for _ in range(2):
            gone = client.post("/models/unload", json={"model": "b"})
            assert (gone.status_code, gone.json()) == (
                200, {"success": True, "model": "b", "status": {"value": "unloaded"}})
        assert (farm.loads, farm.shut) == (["b"], ["b"])


def test_idle_model_unloads_after_its_ttl(tmp_path: Path) -> None:
    farm = Farm()
    with multi_server(tmp_path, ["a", "b"], farm, model_ttl_s=0.2) as client:
        chat(client, "a")
        wait_for(lambda: farm.shut == ["a"])
        assert states(client)["a"] == {"value": "unloaded"}
        assert chat(client, "a").json()["choices"][0]["message"]["content"] == "I am a."
        assert farm.loads == ["a", "a"]


def test_failed_load_answers_its_reason_without_a_path(tmp_path: Path) -> None:
    farm = Farm(fail={"bad": f"cannot read {tmp_path}/bad/model.safetensors\nTraceback (most recent call)"})
    with multi_server(tmp_path, ["a", "bad"], farm) as client:
        failed = chat(client, "bad")
        assert failed.status_code == 503
        error = failed.json()["error"]
        reason = "ValueError: cannot read <bad>/model.safetensors"
        assert (error["message"], error["code"]) == (f"The model 'bad' failed to load: {reason}",
                                                     "model_load_failed")
        assert states(client)["bad"] == {"value": "unloaded", "failed": True, "reason": reason}
        health = client.get("/health")
        assert (health.status_code, health.json()["models"][1]) == (
            200, {"id": "bad", "status": "failed", "error": reason})
        assert chat(client, "a").json()["choices"][0]["message"]["content"] == "I am a."
        assert str(tmp_path) not in client.get("/v1/models").text


def test_a_stream_gets_keepalives_while_its_model_loads(tmp_path: Path) -> None:
    farm = Farm(gates={"a": threading.Event()})
    with multi_server(tmp_path, ["a", "b"], farm, keepalive_interval_s=0.05) as client:
        sock = post_stream(client.port, {"model": "a", "stream": True,  # type: ignore[attr-defined]
                                         "messages": [{"role": "user", "content": "hi"}]})
        raw = b""
        while raw.count(b": keepalive") < 3:
            raw += sock.recv(4096)
        assert b"200 OK" in raw and b"data: " not in raw and farm.loads == ["a"]
        farm.gates["a"].set()
        while not raw.endswith(b"0\r\n\r\n"):
            raw += sock.recv(4096)
        sock.close()
        events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
        text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
        assert (text, events[-1]) == ("I am a.", b"[DONE]")


def test_a_stream_whose_model_fails_to_load_ends_with_an_error_event(tmp_path: Path) -> None:
    farm = Farm(fail={"a": "broken"})
    with multi_server(tmp_path, ["a", "b"], farm) as client:
        with client.stream("POST", "/v1/chat/completions", json={
                "model": "a", "stream": True, "messages": [{"role": "user", "content": "x"}]}) as stream:
            assert stream.status_code == 200
            lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        error = json.loads(lines[0][6:])["error"]
        assert error["message"] == "The model 'a' failed to load: ValueError: broken"
        assert lines[1:] == ["data: [DONE]"]


def test_metrics_label_each_loaded_model(tmp_path: Path) -> None:
    with multi_server(tmp_path, ["a", "b"], Farm()) as client:
        assert client.get("/metrics").status_code == 200
        chat(client, "a")
        chat(client, "b")
        text = client.get("/metrics").text
        assert text.count("# TYPE streamproxy:request_success_total counter") == 1
        for model in ("a", "b"):
            sample = f'streamproxy:request_success_total{{finished_reason="stop",model_name="{model}"}} 1.0'
            assert sample in text


def test_models_file_serves_an_embedding_model_by_its_alias(tmp_path: Path) -> None:
    for name in ("qwen", "bge"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    file = tmp_path / "models.toml"
    file.write_text('[models.chat]\npath = "qwen"\n[models.embed]\npath = "bge"\nkind = "embedding"\n'
                    'aliases = ["text-embedding-3-small"]\n')
    farm = Farm()
    with multi_server(tmp_path, [], farm, models_file=str(file)) as client:
        body = client.post("/v1/embeddings", json={"model": "text-embedding-3-small",
                                                    "input": ["abc", "x"]}).json()
        assert (body["model"], [d["embedding"] for d in body["data"]]) == ("embed", [[3.0, 1.0], [1.0, 1.0]])
        assert farm.loads == []  # an embedding model has no generating engine
        refused = chat(client, "embed")
        assert (refused.status_code, refused.json()["error"]["param"]) == (400, "model")
        assert "is an embedding model" in refused.json()["error"]["message"]
        card = client.get("/v1/models/text-embedding-3-small").json()
        assert (card["id"], card["kind"], card["aliases"], card["status"]) == (
            "embed", "embedding", ["text-embedding-3-small"], {"value": "loaded"})
        assert chat(client, "chat").json()["choices"][0]["message"]["content"] == "I am chat."
        info = client.get("/server_info")
        assert (info.status_code, info.json()["error"]["type"]) == (400, "invalid_request_error")


def test_the_memory_budget_unloads_to_make_room_and_refuses_what_cannot_fit(tmp_path: Path) -> None:
    farm = Farm()  # each model counts 500 bytes of weights + a 1000-byte KV pool (on a thread)
    with multi_server(tmp_path / "fits", ["a", "b", "c"], farm, kv_cache_bytes=1000,
                      models_memory_bytes=3500, engine_process=False) as client:
        for model in ("a", "b", "a", "c"):  # a and b fit together; c makes b (least recently used) go
            assert chat(client, model).json()["choices"][0]["message"]["content"] == f"I am {model}."
        assert (farm.loads, farm.shut) == (["a", "b", "c"], ["b"])
    with multi_server(tmp_path / "small", ["a", "b"], Farm(), kv_cache_bytes=1000,
                      models_memory_bytes=300 << 20) as client:  # in engine processes (the default)
        refused = chat(client, "a")
        message = ("The model 'a' needs about 400 MiB (weights, KV cache and engine process), more than the "
                   "300 MiB the loaded models may take (--models-memory-bytes).")
        assert (refused.status_code, refused.json()["error"]["code"], refused.json()["error"]["message"]) == (
            503, "model_memory_budget", message)
        assert states(client)["a"] == {"value": "unloaded", "failed": True, "reason": message}


def test_two_loads_waiting_for_room_both_finish(tmp_path: Path) -> None:
    farm = Farm(step_s=0.02)
    with multi_server(tmp_path, ["a", "b", "c"], farm, models_max=1) as client:
        chat(client, "a")
        replies: dict[str, httpx.Response] = {}
        with client.stream("POST", "/v1/chat/completions", json={
                "model": "a", "stream": True, "max_tokens": 200,
                "messages": [{"role": "user", "content": "x"}]}) as stream:
            lines = stream.iter_lines()
            next(lines)
            waiters = []
            for model in ("b", "c"):  # both wait for a's room; neither may wait for the other's load
                waiters.append(threading.Thread(target=lambda m=model: replies.update({m: chat(client, m)})))
                waiters[-1].start()
                wait_for(lambda m=model: states(client)[m]["value"] == "loading")
            list(lines)
        for waiter in waiters:
            waiter.join(60)
        assert {m: r.json()["choices"][0]["message"]["content"] for m, r in replies.items()} == {
            "b": "I am b.", "c": "I am c."}
        assert farm.loads[0] == "a" and sorted(farm.loads[1:]) == ["b", "c"]


def test_a_failed_load_is_not_retried_by_requests_for_a_while(tmp_path: Path) -> None:
    """A client retrying a broken model gets its reason at once and unloads nobody (the first try made
    room, as any load does); ``POST /models/load`` tries again at once."""
    farm = Farm(fail={"bad": "broken"})
    with multi_server(tmp_path, ["a", "bad"], farm, models_max=1) as client:
        chat(client, "bad")
        assert chat(client, "a").json()["choices"][0]["message"]["content"] == "I am a."
        for _ in range(3):
            again = chat(client, "bad")
            assert (again.status_code, again.json()["error"]["code"]) == (503, "model_load_failed")
        assert states(client)["a"] == {"value": "loaded"}
        assert (farm.loads, farm.shut) == (["bad", "a"], [])
        retried = client.post("/models/load", json={"model": "bad"})
        assert retried.status_code == 503
        assert (farm.loads, farm.shut) == (["bad", "a", "bad"], ["a"])
