"""A several-model server's edges over scripted engines in a real uvicorn: ``/metrics`` while no model
is loaded, a shutdown while a request waits for its model's load, and the ``Retry-After`` of a 503
while a model loads; the one-model server's load failure shows the user's path in the log line the
CLI prints, never over HTTP; a loaded model serves only once the read-ahead of the models' files
(``ModelRegistry.before_serving``) has ended."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from proxy.api import multi
from proxy.api.app import create_app
from proxy.api.registry import ModelRegistry
from proxy.api.state import ServerState, loading_retry_after_s
from proxy.catalog import ModelEntry, build_catalog
from proxy.settings import Settings

from .test_models_registry import Farm, chat, multi_server, states, wait_for

SHUTDOWN = {"message": "The server is shutting down; the response was cut short. Retry the request.",
            "type": "server_error", "param": None, "code": "server_shutdown"}


def test_metrics_show_every_models_state_while_none_is_loaded(tmp_path: Path) -> None:
    with multi_server(tmp_path, ["a", "b"], Farm()) as client:
        idle = client.get("/metrics")
        assert idle.status_code == 200
        for model in ("a", "b"):
            for state, value in (("unloaded", 1.0), ("loading", 0.0), ("loaded", 0.0), ("failed", 0.0)):
                assert f'streamproxy:model_state{{model_name="{model}",state="{state}"}} {value}' in idle.text
        assert "streamproxy:responses_store_entries 0.0" in idle.text
        assert "streamproxy:request_success_total" not in idle.text  # no engine: no per-model families
        chat(client, "a")
        text = client.get("/metrics").text
        assert 'streamproxy:model_state{model_name="a",state="loaded"} 1.0' in text
        assert 'streamproxy:model_state{model_name="a",state="unloaded"} 0.0' in text
        assert 'streamproxy:model_state{model_name="b",state="unloaded"} 1.0' in text
        assert text.count("# TYPE streamproxy:model_state gauge") == 1
        assert 'streamproxy:request_success_total{finished_reason="stop",model_name="a"} 1.0' in text


def _drain(client: httpx.Client, grace_s: float) -> None:
    """``begin_drain`` on the server's loop, as SIGTERM calls it (``proxy.cli.DrainingServer``)."""
    state = client.app.state.server  # type: ignore[attr-defined]
    client.loop.call_soon_threadsafe(state.begin_drain, grace_s)  # type: ignore[attr-defined]
    wait_for(lambda: state.is_draining)


def test_a_request_waiting_for_its_model_at_shutdown_is_served_when_the_load_ends_in_the_grace(
        tmp_path: Path) -> None:
    farm = Farm(gates={"a": threading.Event()})
    with multi_server(tmp_path, ["a", "b"], farm) as client:
        replies: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: replies.append(chat(client, "a")))
        waiter.start()
        wait_for(lambda: states(client)["a"] == {"value": "loading"})
        _drain(client, 30.0)
        refused = chat(client, "b")  # came after the shutdown began
        assert (refused.status_code, refused.json()["error"]["code"]) == (503, "server_shutdown")
        farm.gates["a"].set()
        waiter.join(30)
        assert (replies[0].status_code, replies[0].json()["choices"][0]["message"]["content"]) == (
            200, "I am a.")
        assert farm.loads == ["a"]


def test_requests_waiting_for_a_load_at_the_end_of_the_grace_period_end_with_server_shutdown(
        tmp_path: Path) -> None:
    farm = Farm(gates={"a": threading.Event()})
    with multi_server(tmp_path, ["a", "b"], farm, keepalive_interval_s=0.05) as client:
        plain: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: plain.append(chat(client, "a")))
        waiter.start()
        lines: list[str] = []
        kept_alive = threading.Event()

        def stream() -> None:
            with client.stream("POST", "/v1/chat/completions", json={
                    "model": "a", "stream": True, "messages": [{"role": "user", "content": "x"}]}) as reply:
                for line in reply.iter_lines():
                    lines.append(line)
                    if line == ": keepalive":
                        kept_alive.set()

        wait_for(lambda: states(client)["a"] == {"value": "loading"})  # the plain request's load
        streamer = threading.Thread(target=stream)
        streamer.start()
        assert kept_alive.wait(30)  # both requests wait for the load before the shutdown begins
        _drain(client, 0.3)
        waiter.join(30)
        streamer.join(30)
        assert not farm.gates["a"].is_set() and states(client)["a"] == {"value": "loading"}  # still loading
        assert (plain[0].status_code, plain[0].json()) == (503, {"error": SHUTDOWN})
        events = [line[6:] for line in lines if line.startswith("data: ")]
        assert ": keepalive" in lines and events == [json.dumps({"error": SHUTDOWN}), "[DONE]"]


def test_the_retry_after_of_a_load_is_as_long_again_within_5_and_60_seconds() -> None:
    assert [loading_retry_after_s(s) for s in (0.0, 4.2, 12.2, 59.5, 1000.0)] == [5, 5, 13, 60, 60]


async def _while_loading(paths: list[str]) -> list[httpx.Response]:
    gate = threading.Event()

    def factory(_: Settings) -> Any:
        gate.wait(30)
        raise RuntimeError("the test is over")  # the load never ends while the test asks

    app = create_app(Settings(served_model_name="m"), factory)
    transport = httpx.ASGITransport(app=app)
    try:
        async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport,
                                                                       base_url="http://t") as client:
            app.state.server.loading_since = time.monotonic() - 30.4  # 30.4 s into the load: 31 s more
            body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
            return [await client.post(path, json=body) for path in paths]
    finally:
        gate.set()


def test_a_503_while_the_model_loads_says_when_to_retry() -> None:
    chat_reply, messages_reply = asyncio.run(_while_loading(["/v1/chat/completions", "/v1/messages"]))
    assert (chat_reply.status_code, chat_reply.headers["retry-after"]) == (503, "31")
    assert chat_reply.json()["error"]["message"] == "The model is still loading; retry shortly."
    assert (messages_reply.status_code, messages_reply.headers["retry-after"]) == (503, "31")
    assert messages_reply.json()["error"]["type"] == "overloaded_error"


async def _failed_load(path: Path) -> tuple[list[str], dict[str, Any]]:
    def factory(_: Settings) -> Any:
        raise ValueError(f"--model {str(path)!r}: not a Hugging Face folder or a .gguf file\nTraceback")

    reasons: list[str] = []
    app = create_app(Settings(model=str(path)), factory, on_load_failed=reasons.append)
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport,
                                                                   base_url="http://t") as client:
        while app.state.server.status == "loading":
            await asyncio.sleep(0.01)
        return reasons, (await client.get("/health")).json()


def test_a_lone_models_load_failure_shows_its_path_to_the_user_and_hides_it_over_http(tmp_path: Path) -> None:
    path = tmp_path / "my-model"
    reasons, health = asyncio.run(_failed_load(path))
    assert reasons == [f"ValueError: --model '{path}': not a Hugging Face folder or a .gguf file"]
    assert health["error"] == ("Loading the model failed: ValueError: --model '<the model>': not a "
                               "Hugging Face folder or a .gguf file")
    assert str(tmp_path) not in json.dumps(health)



async def _loads_with(tmp: Path, farm: Farm) -> list[tuple[str, str]]:
    used: list[tuple[str, str]] = []
    for name in ("a", "b"):
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text("{}")
    settings = Settings(model=str(tmp / "a"), extra_models=(str(tmp / "b"),), models_memory_bytes=0)

    def plain(s: Settings) -> Any:
        used.append((s.served_model_name or "", "plain"))
        return farm.factory(s)

    def yielding(s: Settings) -> Any:
        used.append((s.served_model_name or "", "yielding"))
        return farm.factory(s)

    registry = multi.build_registry(settings, build_catalog(settings), ServerState(settings), plain,
                                    lambda s, m: None, yielding)
    for name in ("a", "b"):
        await registry.ensure_loaded(registry.find(name))
    await registry.unload(registry.find("a"), "test")
    await registry.unload(registry.find("b"), "test")
    await registry.ensure_loaded(registry.find("b"))
    await registry.close()
    return used


def test_a_load_yields_the_cores_only_while_another_model_serves(tmp_path: Path) -> None:
    """The first load (nothing to yield to) runs at the server's priority; a load beside a loaded model
    with the yielding factory (``on_demand_engine_factory``: nice 19)."""
    used = asyncio.run(_loads_with(tmp_path, Farm()))
    assert used == [("a", "plain"), ("b", "yielding"), ("b", "plain")]


def _registry_of_a() -> ModelRegistry:
    """One model, ``A``, whose load and unload do nothing."""
    async def load(_: Any) -> tuple[None, None]:
        return None, None

    async def unload(_: Any) -> None:
        return None

    return ModelRegistry((ModelEntry("A", "/nowhere"),), lambda e: Settings(), load, unload,
                         lambda exc, slot: str(exc))


async def _statuses_while_before_serving_runs() -> list[str]:
    registry = _registry_of_a()
    ahead: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    registry.before_serving = ahead
    slot = registry.find("A")
    loading = asyncio.create_task(registry.ensure_loaded(slot))
    seen: list[str] = []
    for _ in range(10):  # the load itself returns at once
        await asyncio.sleep(0)
        seen.append(slot.status)
    ahead.set_result(None)
    await loading
    seen.append(slot.status)
    return seen


def test_a_loaded_model_serves_only_once_the_read_ahead_has_ended() -> None:
    # the read-ahead of the models' files holds the interpreter lock: no stream may run beside it
    seen = asyncio.run(_statuses_while_before_serving_runs())
    assert seen[-6:] == ["loading"] * 5 + ["loaded"]


async def _reserved_while_loading(tmp: Path) -> tuple[list[int], list[int], list[int], list[int]]:
    farm = Farm(gates={"b": threading.Event(), "c": threading.Event()})
    for name in ("a", "b", "c"):
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text("{}")
    settings = Settings(model=str(tmp / "a"), extra_models=(str(tmp / "b"), str(tmp / "c")),
                        models_memory_bytes=0)
    registry = multi.build_registry(settings, build_catalog(settings), ServerState(settings), farm.factory,
                                    lambda s, m: None, farm.factory)
    farm.gates["a"] = threading.Event()
    farm.gates["a"].set()
    await registry.ensure_loaded(registry.find("a"))
    a = farm.engines["a"]
    assert a.reserved_cores == []  # the first load has nothing to yield to
    polls: list[int] = []  # loads started when a was asked whether it applied the reservation

    def applied_at_the_third_ask() -> bool:
        polls.append(len(farm.loads))
        return len(polls) >= 3

    a.cores_reserved = applied_at_the_third_ask  # type: ignore[method-assign]
    b_load = asyncio.ensure_future(registry.ensure_loaded(registry.find("b")))
    c_load = asyncio.ensure_future(registry.ensure_loaded(registry.find("c")))
    while sorted(farm.loads) != ["a", "b", "c"]:
        await asyncio.sleep(0.02)
    during = list(a.reserved_cores)  # b and c load beside a
    farm.gates["b"].set()
    await b_load
    b_during = list(farm.engines["b"].reserved_cores)  # b loaded while c still loads
    farm.gates["c"].set()
    await c_load
    await registry.close()
    return during, b_during, a.reserved_cores, polls


def test_loaded_models_leave_a_core_to_the_loads_beside_them_until_the_last_ends(tmp_path: Path) -> None:
    """While a model loads beside loaded ones, each loaded one steps with a core fewer
    (``EngineClient.reserve_cores``, ``proxy.api.multi.LOAD_RESERVED_CORES``); a model that finishes
    loading while another still loads does too; the last load's end gives the cores back. A load
    starts once the loaded engines say they applied it (``EngineClient.cores_reserved``)."""
    during, b_during, a_all, polls = asyncio.run(_reserved_while_loading(tmp_path))
    assert polls[:2] == [1, 1]  # b's and c's loads waited for a
    assert during == [1, 1]
    assert b_during == [1]
    assert a_all[-1] == 0 and a_all.count(0) == 1


async def _unload_beside_a_request() -> None:
    registry = _registry_of_a()
    slot = registry.find("A")
    await registry.ensure_loaded(slot)
    slot.in_flight = 1
    unloading = asyncio.create_task(registry.unload(slot, "POST /models/unload"))
    await asyncio.sleep(0.3)
    assert slot.status == "loaded"  # the request in flight ends first
    slot.in_flight = 0
    await unloading
    assert slot.status == "unloaded"


def test_an_unloads_log_line_says_how_long_it_waited_for_the_requests_in_flight(caplog: Any) -> None:
    with caplog.at_level("INFO", logger="proxy.api"):
        asyncio.run(_unload_beside_a_request())
    line = next(r.getMessage() for r in caplog.records if "unloaded in" in r.getMessage())
    assert line.startswith("model 'A' unloaded in 0.0 s (POST /models/unload; after 0.")
    assert line.endswith(" s waiting for its load or requests in flight)")

