"""Errors of the Messages API: a table of bad bodies (each a 4xx in Anthropic's envelope naming what
is wrong, never a 5xx), statuses of the serving states (404, 529, 503), API keys (``x-api-key`` and
``Authorization: Bearer`` on every endpoint), ``anthropic-*`` headers, ``?beta=true``, ``HEAD /``."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import reply_ids, run, serve
from .fakes import FakeEngine, make_tokenizer
from .messages_sse import TOOL, body

USER = {"role": "user", "content": "Hi"}


def _with(**kw: Any) -> dict[str, Any]:
    return {**body(), **kw}


def _without(key: str) -> dict[str, Any]:
    return {k: v for k, v in body().items() if k != key}


BAD = [  # (body, status, words the message must contain)
    (_without("max_tokens"), 400, "'max_tokens' is required"),
    (_with(max_tokens=0), 400, "'max_tokens' must be at least 1"),
    (_with(max_tokens="many"), 400, "'max_tokens' must be an integer"),
    (_with(model="claude-sonnet-4-5"), 404, "does not exist"),
    (_with(messages=[]), 400, "at least one message"),
    (_with(messages="Hi"), 400, "'messages' must be an array"),
    (_with(messages=[{"role": "tool", "content": "x"}]), 400, "'messages[0].role' must be one of"),
    (_with(messages=[{"role": "user", "content": 3}]), 400, "'messages[0].content' must be a string"),
    (_with(messages=[{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AA=="}}]}]), 400,
     "'messages[0].content[0]' is an image, but the model 'test-model' reads text only"),
    (_with(system="Be brief.", messages=[{"role": "user", "content": [{"type": "text", "text": "Look"}, {
        "type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]), 400,
     "'messages[0].content[1]' is an image, but the model 'test-model' reads text only"),
    (_with(messages=[{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/svg+xml", "data": "AA=="}}]}]), 400,
     "'messages[0].content[0].source.media_type' must be one of image/jpeg"),
    (_with(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "file",
                                                                               "file_id": "f"}}]}]), 400,
     "'messages[0].content[0].source.type' 'file' is not supported"),
    (_with(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]), 400,
     "'document' is not supported"),
    (_with(messages=[{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]), 400, "not allowed in a user message"),
    (_with(messages=[{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]), 400,
     "'messages[0].content[0].tool_use_id' is required"),
    (_with(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                   "content": [{"type": "image", "source": {}}]}]}]),
     400, "'messages[0].content[0].content[0].type' must be 'text' in a tool_result; got 'image'"),
    (_with(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                   "is_error": "yes"}]}]), 400,
     "is_error' must be a boolean"),
    (_with(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                        "input": "{}"}]}]), 400, ".input' must be an object"),
    (_with(messages=[{"role": "user", "content": [{"text": "no type"}]}]), 400, ".type' is required"),
    (_with(system=5), 400, "'system' must be a string or an array"),
    (_with(system=[{"type": "image"}]), 400, "'system[0].type' must be 'text'; got 'image'"),
    (_with(system=[{"type": "text"}]), 400, "'system[0].text' is required"),
    (_with(temperature=1.5), 400, "'temperature' must be in [0, 1]"),
    (_with(top_p=2), 400, "'top_p' must be in"),
    (_with(top_k="x"), 400, "'top_k' must be an integer"),
    (_with(stop_sequences=[""]), 400, "'stop_sequences[0]' must not be empty"),
    (_with(stop_sequences=[1]), 400, "'stop_sequences[0]' must be a string"),
    (_with(stream="yes"), 400, "'stream' must be a boolean"),
    (_with(metadata="x"), 400, "'metadata' must be an object"),
    (_with(metadata={"user_id": 5}), 400, "'metadata.user_id' must be a string"),
    (_with(tools=[{"type": "web_search_20250305", "name": "web_search"}]), 400,
     "Server tool 'web_search_20250305' is not supported"),
    (_with(tools=[{"type": "bash_20250124", "name": "bash"}]), 400, "Server tool 'bash_20250124'"),
    (_with(tools=[{"name": "f"}]), 400, "'tools[0].input_schema' is required"),
    (_with(tools=[{"input_schema": {"type": "object"}}]), 400, "'tools[0].name' is required"),
    (_with(tools=[TOOL, TOOL]), 400, "Duplicate tool name"),
    (_with(tools=[TOOL], tool_choice={"type": "tool", "name": "nope"}), 400,
     "'tool_choice' names the function"),
    (_with(tools=[TOOL], tool_choice={"type": "tool"}), 400, "'tool_choice.name' is required"),
    (_with(tools=[TOOL], tool_choice={"type": "sometimes"}), 400, "'tool_choice.type' must be one of"),
    (_with(tools=[TOOL], tool_choice="auto"), 400, "'tool_choice' must be an object"),
    (_with(tools=[TOOL], tool_choice={"type": "auto", "disable_parallel_tool_use": 1}), 400,
     "disable_parallel_tool_use' must be a boolean"),
    (_with(tool_choice={"type": "any"}), 400, "only allowed when 'tools' are specified"),
    (_with(thinking={"type": "enabled"}), 400, "'thinking.budget_tokens' is required"),
    (_with(thinking={"type": "enabled", "budget_tokens": 100}), 400,
     "'thinking.budget_tokens' must be at least 1024"),
    (_with(thinking={"type": "enabled", "budget_tokens": 2000}), 400, "must be less than 'max_tokens'"),
    (_with(thinking={"type": "on"}), 400, "'thinking.type' must be one of"),
    (_with(thinking=True), 400, "'thinking' must be an object"),
    (_with(thinking={"type": "adaptive", "display": "full"}), 400, "'thinking.display' must be one of"),
    (_with(output_config={"effort": "extreme"}), 400, "'output_config.effort' must be one of"),
    (_with(output_config={"format": {"type": "xml"}}), 400, "'output_config.format' must be"),
    (_with(container="c1"), 400, "'container' is not supported"),
    (_with(mcp_servers=[{"type": "url", "url": "http://x", "name": "x"}]), 400, "'mcp_servers'"),
]


@pytest.mark.parametrize("bad,status,words", BAD, ids=[w[:40] for _, _, w in BAD])
def test_bad_bodies_are_4xx_in_anthropic_envelope(bad: dict[str, Any], status: int, words: str) -> None:
    async def main():
        async with serve(FakeEngine(reply_ids=reply_ids(make_tokenizer()))) as s:
            create = await s.client.post("/v1/messages", json=bad)
            stream = await s.client.post("/v1/messages", json={**bad, "stream": True} if "stream" not in bad
                                         else bad)
            return create, stream

    for r in run(main()):
        assert r.status_code == status, r.text
        err = r.json()
        assert set(err) == {"type", "error"} and err["type"] == "error"
        assert err["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
        assert words in err["error"]["message"], err


def test_count_tokens_refuses_a_budget_as_create_does() -> None:
    """A thinking budget the model cannot close (no reasoning parser) is the same 400 from
    ``count_tokens`` as from ``POST /v1/messages``, naming ``thinking.budget_tokens``."""
    thinking = {"type": "enabled", "budget_tokens": 1024}

    async def main():
        async with serve(FakeEngine(reply_ids=reply_ids(make_tokenizer()))) as s:
            create = await s.client.post("/v1/messages", json=_with(max_tokens=2000, thinking=thinking))
            count = await s.client.post("/v1/messages/count_tokens", json={
                k: v for k, v in _with(thinking=thinking).items() if k != "max_tokens"})
            return create, count

    create, count = run(main())
    assert (create.status_code, count.status_code) == (400, 400), count.text
    assert create.json() == count.json()
    assert "'thinking.budget_tokens' cannot be enforced" in count.json()["error"]["message"]


def test_body_that_is_not_json_and_unknown_route_and_method() -> None:
    async def main():
        async with serve() as s:
            return (await s.client.post("/v1/messages", content=b"{nope"),
                    await s.client.get("/v1/messages"),
                    await s.client.post("/v1/messages/batches", json={}))

    not_json, get, batches = run(main())
    assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "invalid_request_error"
    assert get.status_code == 405 and get.json()["type"] == "error"
    assert batches.status_code == 404 and batches.json()["error"]["type"] == "not_found_error"


def test_full_queue_is_529_overloaded_and_a_dead_engine_503() -> None:
    async def main():
        engine = FakeEngine(reply_ids=reply_ids(make_tokenizer()), max_waiting=0)
        async with serve(engine) as s:
            full = await s.client.post("/v1/messages", json=body())
            engine.is_healthy = False
            dead = await s.client.post("/v1/messages", json=body(stream=True))
            return full, dead

    full, dead = run(main())
    assert full.status_code == 529 and full.headers["retry-after"] == "1"
    assert full.json()["error"]["type"] == "overloaded_error"
    assert dead.status_code == 503 and dead.json()["error"]["type"] == "overloaded_error"


def test_api_keys_headers_beta_query_and_head_root() -> None:
    async def main():
        async with serve(api_keys=("sk-1",)) as s:
            c = s.client
            anthropic_headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "a-1,b-2"}
            return {
                "x_api_key": await c.post("/v1/messages?beta=true", json=body(),
                                          headers={"x-api-key": "sk-1", **anthropic_headers}),
                "bearer": await c.post("/v1/messages/count_tokens?beta=true", json=body(),
                                       headers={"Authorization": "Bearer sk-1", **anthropic_headers}),
                "missing": await c.post("/v1/messages", json=body()),
                "wrong": await c.post("/v1/messages", json=body(), headers={"x-api-key": "sk-2"}),
                "models_x": await c.get("/v1/models", headers={"x-api-key": "sk-1"}),
                "models_wrong": await c.get("/v1/models", headers={"x-api-key": "nope"}),
                "head": await c.head("/"),
            }

    r = run(main())
    assert r["x_api_key"].status_code == 200 and r["bearer"].status_code == 200
    for key in ("missing", "wrong"):
        assert r[key].status_code == 401
        assert r[key].json()["error"]["type"] == "authentication_error" and r[key].json()["type"] == "error"
    assert r["models_x"].status_code == 200
    assert r["models_wrong"].status_code == 401
    assert r["models_wrong"].json()["error"]["code"] == "invalid_api_key"
    assert r["head"].status_code == 200


@pytest.mark.parametrize("ui", [True, False])
def test_head_root_answers_with_and_without_the_ui(ui: bool) -> None:
    async def main():
        async with serve(ui=ui) as s:
            return await s.client.head("/")

    assert run(main()).status_code == 200
