"""/health, /v1/models and /v1/models/{id}; 503 while loading and after the engine died."""

from __future__ import annotations

import asyncio
import threading

import httpx

from proxy.api.app import EngineFactory, create_app
from proxy.engine.client import EngineClient
from proxy.settings import Settings

from .conftest import MODEL, chat_body, run, serve
from .fakes import FakeEngine, fake_client


def test_models_list_and_get():
    async def main():
        async with serve() as s:
            return (await s.client.get("/v1/models"), await s.client.get(f"/v1/models/{MODEL}"),
                    await s.client.get("/v1/models/other/model"))

    lst, one, other = run(main())
    card = one.json()
    assert lst.json() == {"object": "list", "data": [card]}
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "streamproxy"
    assert isinstance(card["created"], int) and card["max_model_len"] == 128
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"


def test_health_503_while_loading_then_200_then_503_when_engine_dies():
    release = threading.Event()
    engine = FakeEngine()

    def factory(_: Settings) -> EngineClient:
        release.wait(10)
        return fake_client(engine, MODEL, 128)

    async def main():
        app = create_app(Settings(), factory)
        async with app.router.lifespan_context(app), \
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            loading = await c.get("/health")
            chat_loading = await c.post("/v1/chat/completions", json=chat_body())
            release.set()
            for _ in range(200):
                if app.state.server.status == "ready":
                    break
                await asyncio.sleep(0.01)
            ready = await c.get("/health")
            engine.is_healthy = False
            dead = await c.get("/health")
            chat_dead = await c.post("/v1/chat/completions", json=chat_body())
            return loading, chat_loading, ready, dead, chat_dead

    loading, chat_loading, ready, dead, chat_dead = run(main())
    assert loading.status_code == 503 and loading.json()["status"] == "loading"
    assert chat_loading.status_code == 503 and chat_loading.json()["error"]["code"] == "service_unavailable"
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert ready.json()["num_running"] == 0
    assert dead.status_code == 503 and dead.json()["status"] == "dead"
    assert chat_dead.status_code == 503 and chat_dead.json()["error"]["code"] == "engine_dead"


async def _health_once_loaded(factory: EngineFactory) -> httpx.Response:
    """``GET /health`` of an app over ``factory`` once its load has ended (ready or failed; 5 s at most)."""
    app = create_app(Settings(), factory)
    async with app.router.lifespan_context(app):
        for _ in range(500):
            if app.state.server.status != "loading":
                break
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get("/health")


def test_failed_load_is_503_with_reason():
    def factory(_: Settings) -> EngineClient:
        raise FileNotFoundError("no such model")

    r = run(_health_once_loaded(factory))
    assert r.status_code == 503
    assert r.json() == {
        "status": "failed",
        "error": "Loading the model failed: FileNotFoundError: no such model",
    }


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_endpoint_records_requests():
    async def main():
        async with serve() as s:
            await s.client.post("/v1/chat/completions", json=chat_body(max_tokens=3))
            await s.client.post("/v1/chat/completions", json=chat_body(stop=["END"], stream=True))
            s.engine.max_waiting = 0
            await s.client.post("/v1/chat/completions", json=chat_body())
            return await s.client.get("/metrics"), s.tokenizer

    r, tok = run(main())
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = _samples(r.text)
    lab = (("model_name", MODEL),)
    assert m[("streamproxy:request_success_total", (("finished_reason", "length"), *lab))] == 1
    assert m[("streamproxy:request_success_total", (("finished_reason", "stop"), *lab))] == 1
    assert m[("streamproxy:request_rejected_total", (*lab, ("reason", "queue_full")))] == 1
    num_stop = len(tok.encode("Hello world! alpha beta 你好 🤗 END"))  # tokens up to the one completing "END"
    assert m[("streamproxy:generation_tokens_total", lab)] == 3 + num_stop
    assert m[("streamproxy:time_to_first_token_seconds_count", lab)] == 2
    assert m[("streamproxy:inter_token_latency_seconds_count", lab)] == 2 + num_stop - 1
    assert m[("streamproxy:num_requests_running", lab)] == 0


def test_model_card_and_ready_line_say_what_is_served():
    from proxy.api.app import ready_message
    from proxy.protocol.responses import model_card

    served = "gguf: Q4_1 -> int4 g32 x210, Q8_0 -> int8 g32 x1, token_embd Q8_0 -> int8 g32 x1"
    card = model_card("m", 7, 128, dtype="bfloat16", quantization=served)
    assert card == {
        "id": "m",
        "object": "model",
        "created": 7,
        "owned_by": "streamproxy",
        "max_model_len": 128,
        "dtype": "bfloat16",
        "quantization": served,
    }
    assert "dtype" not in model_card("m", 7, 128)
    line = ready_message(Settings(), "m", f"dtype bfloat16, quantization {served}")
    assert line.startswith(f"streamproxy ready: serving 'm' (dtype bfloat16, quantization {served}) at http://")
    assert ready_message(Settings(), "m").startswith("streamproxy ready: serving 'm' at http://")


def test_the_model_loads_on_a_thread_that_ends_before_serving():
    """The engine factory runs on its own thread, which has ended when the engine starts: a thread
    that outlived the load would keep torch's OpenMP team beside the engine thread's, and libgomp
    then cuts its workers' spin-waits (batch-1 decode 2.3x slower, ``in_own_thread``). A load error
    raised on that thread reaches the awaiting task."""
    from proxy.api.app import in_own_thread

    loaders: list[threading.Thread] = []

    def factory(settings: Settings) -> EngineClient:
        loaders.append(threading.current_thread())
        return fake_client(FakeEngine())

    def failing(settings: Settings) -> EngineClient:
        raise RuntimeError("no weights")

    async def main():
        health = await _health_once_loaded(factory)
        with_error = None
        try:
            await in_own_thread(failing, Settings())
        except RuntimeError as exc:
            with_error = str(exc)
        return health, with_error

    health, with_error = run(main())
    assert health.status_code == 200 and with_error == "no weights"
    (loader,) = loaders
    assert loader is not threading.main_thread() and loader.name == "streamproxy-load"
    loader.join(timeout=5)
    assert not loader.is_alive()
