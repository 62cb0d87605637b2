"""The Responses API in-process (FakeEngine, tiny tokenizer): every refused field, built-in tool and
malformed item is a 4xx OpenAI error object naming the Responses field; a fuzz of request bodies never
gets a 5xx; a stored response reads back equal to the body that was returned."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import MODEL, REPLY, run, serve
from .fakes import FakeEngine, make_tokenizer, thread_server

FN = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}

# (name, body fields, status, param)
BAD = [
    ("background", {"background": True}, 400, "background"),
    ("conversation", {"conversation": "conv_1"}, 400, "conversation"),
    ("prompt", {"prompt": {"id": "pmpt_1"}}, 400, "prompt"),
    ("max_tool_calls", {"max_tool_calls": 2}, 400, "max_tool_calls"),
    ("truncation auto", {"truncation": "auto"}, 400, "truncation"),
    *[
        (f"tool {kind}", {"tools": [FN, {"type": kind}]}, 400, "tools[1].type")
        for kind in (
            "web_search",
            "file_search",
            "computer_use_preview",
            "code_interpreter",
            "image_generation",
            "mcp",
        )
    ],
    (
        "input_image",
        {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is this?"},
                        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
                    ],
                }
            ]
        },
        400,
        "input[0].content[1]",
    ),
    (
        "function_call_output without call_id",
        {"input": [{"role": "user", "content": "hi"}, {"type": "function_call_output", "output": "1"}]},
        400,
        "input[1].call_id",
    ),
    (
        "function_call without call_id",
        {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
        400,
        "input[0].call_id",
    ),
    ("unknown item type", {"input": [{"type": "banana"}]}, 400, "input[0].type"),
    ("unknown role", {"input": [{"role": "robot", "content": "hi"}]}, 400, "input[0].role"),
    ("input missing", {"input": None}, 400, "input"),
    ("unknown previous_response_id", {"previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    (
        "invalid schema",
        {
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "x",
                    "schema": {"type": "object", "properties": {"a": {"type": 7}}},
                }
            }
        },
        400,
        "text.format.schema",
    ),
    ("schema missing", {"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
    ("format type", {"text": {"format": {"type": "yaml"}}}, 400, "text.format.type"),
    ("max_output_tokens 0", {"max_output_tokens": 0}, 400, "max_output_tokens"),
    ("include unknown", {"include": ["reasoning.encrypted_content", "bogus.include"]}, 400, "include[1]"),
    ("metadata key of 65", {"metadata": {"k" * 65: "v"}}, 400, "metadata"),
    ("metadata value of 513", {"metadata": {"k": "v" * 513}}, 400, "metadata"),
    # the context check names the Responses API's fields, not chat's messages / max_tokens
    ("input past the context", {"input": "alpha beta " * 5000}, 400, "input"),
    ("max_output_tokens past the context", {"max_output_tokens": 10**6}, 400, "max_output_tokens"),
    ("temperature 3", {"temperature": 3}, 400, "temperature"),
    ("tool_choice hosted", {"tool_choice": {"type": "web_search"}}, 400, "tool_choice.type"),
    ("store string", {"store": "yes"}, 400, "store"),
]


def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Any:
    return client.post(path, json=body)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_bad_input_is_a_named_4xx(stream: bool) -> None:
    async def main() -> None:
        async with serve(with_grammar=True) as s:
            for name, fields, status, param in BAD:
                body = {"model": MODEL, "input": "hi", "stream": stream, **fields}
                body = {k: v for k, v in body.items() if v is not None}
                for path in ("/v1/responses", "/v1/responses/input_tokens"):
                    r = await s.client.post(path, json=body)
                    assert r.status_code == status, (name, path, r.text)
                    err = r.json()["error"]
                    assert set(err) == {"message", "type", "param", "code"}, name
                    assert err["param"] is not None and err["param"].startswith(param), (name, err)
                    assert err["type"] == "invalid_request_error", err  # also for 404s, as OpenAI

    run(main())


def test_bad_schema_names_the_schema_path() -> None:
    async def main() -> None:
        async with serve(with_grammar=True) as s:
            r = await s.client.post(
                "/v1/responses",
                json={
                    "model": MODEL,
                    "input": "hi",
                    "text": {
                        "format": {
                            "type": "json_schema",
                            "name": "x",
                            "schema": {"type": "object", "properties": {"a": {"type": 7}}},
                        }
                    },
                },
            )
            assert r.status_code == 400
            err = r.json()["error"]
            assert (
                err["param"].startswith("text.format.schema") and "response_format" not in err["message"]
            ), err

    run(main())


def test_get_equals_the_body_and_input_items() -> None:
    async def main() -> None:
        async with serve() as s:
            r = await s.client.post(
                "/v1/responses",
                json={"model": MODEL, "input": "hi", "instructions": "Be kind.", "metadata": {"k": "v"}},
            )
            assert r.status_code == 200
            body = r.json()
            assert body["status"] == "completed" and body["output"][0]["content"][0]["text"] == REPLY
            assert body["metadata"] == {"k": "v"} and body["instructions"] == "Be kind."
            got = await s.client.get(f"/v1/responses/{body['id']}")
            assert got.status_code == 200 and got.json() == body
            items = (await s.client.get(f"/v1/responses/{body['id']}/input_items")).json()
            assert [(i["type"], i["role"], i["content"], i["status"]) for i in items["data"]] == [
                ("message", "user", [{"type": "input_text", "text": "hi"}], "completed")
            ]
            assert items["data"][0]["id"].startswith("msg_")
            assert items["has_more"] is False and items["first_id"] == items["data"][0]["id"]
            unknown = await s.client.get("/v1/responses/resp_nope")
            assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "response_not_found"
            # cancel: only background responses can be, and this server runs none
            cancel = await s.client.post(f"/v1/responses/{body['id']}/cancel")
            assert cancel.status_code == 400 and "background" in cancel.json()["error"]["message"]
            assert cancel.json()["error"]["type"] == "invalid_request_error"
            cancel = await s.client.post("/v1/responses/resp_nope/cancel")
            assert cancel.status_code == 404 and cancel.json()["error"]["code"] == "response_not_found"

    run(main())


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
FIELDS = [
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "text",
    "max_output_tokens",
    "temperature",
    "top_p",
    "store",
    "metadata",
    "include",
    "reasoning",
    "previous_response_id",
    "truncation",
    "parallel_tool_calls",
    "top_logprobs",
    "stream",
    "background",
    "user",
    "seed",
]
ITEM = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(
            ["message", "function_call", "function_call_output", "reasoning", "item_reference", "x"]
        ),
        "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
        "content": st.text(max_size=5)
        | st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["input_text", "output_text", "input_image", "x"])},
                optional={"text": JSON},
            ),
            max_size=2,
        )
        | JSON,
        "call_id": JSON,
        "name": JSON,
        "arguments": JSON,
        "output": JSON,
        "summary": JSON,
    },
)


def bodies(stored_id: str) -> st.SearchStrategy[dict[str, Any]]:
    """Request bodies, some continuing the stored response ``stored_id``."""
    return st.fixed_dictionaries(
        {"model": st.just(MODEL), "max_output_tokens": st.integers(1, 4) | JSON},
        optional={
            "input": st.text(max_size=8) | st.lists(ITEM, max_size=3) | JSON,
            "previous_response_id": st.just(stored_id) | JSON,
            **{f: JSON for f in FIELDS if f not in ("input", "max_output_tokens", "previous_response_id")},
        },
    )


def test_fuzzed_bodies_never_5xx() -> None:
    tokenizer = make_tokenizer()
    engine = FakeEngine(reply_ids=list(tokenizer.encode("ok")))
    with (
        thread_server(engine) as (port, _),
        httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client,
    ):
        stored = client.post("/v1/responses", json={"model": MODEL, "input": "hi"}).json()["id"]

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(bodies(stored), st.sampled_from(["/v1/responses", "/v1/responses/input_tokens"]))
        def check(body: dict[str, Any], path: str) -> None:
            r = client.post(path, json=body)
            assert r.status_code < 500, (body, r.status_code, r.text)
            if r.status_code >= 400:
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}, err

        check()


def test_continuation_errors_name_this_requests_input_index() -> None:
    async def main() -> None:
        async with serve() as s:
            first = (await s.client.post("/v1/responses", json={"model": MODEL, "input": "hi"})).json()
            r = await s.client.post(
                "/v1/responses",
                json={
                    "model": MODEL,
                    "previous_response_id": first["id"],
                    "input": [
                        {"role": "user", "content": "ok"},
                        {"type": "function_call_output", "output": "1"},
                    ],
                },
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "input[1].call_id", r.text

    run(main())


def test_an_output_without_its_call_is_refused_and_a_cut_call_continues() -> None:
    """A ``function_call_output`` whose ``call_id`` no call of the conversation has is a 400 naming
    it (as OpenAI answers); a stored call whose arguments ``max_output_tokens`` cut (not JSON) is
    accepted back, by ``previous_response_id`` or sent as an item (OpenAI accepts any string)."""
    async def main():
        async with serve() as s:
            orphan = await s.client.post("/v1/responses", json={"model": MODEL, "input": [
                {"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "zz",
                                                    "output": "x"}]})
            cut = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                   "arguments": '{"city":'}
            sent = await s.client.post("/v1/responses", json={"model": MODEL, "input": [
                {"role": "user", "content": "Weather?"}, cut,
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]})
            chat = await s.client.post("/v1/chat/completions", json={"model": MODEL, "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                       "arguments": '{"city":'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
            return orphan, sent, chat

    orphan, sent, chat = run(main())
    assert orphan.status_code == 400 and orphan.json()["error"]["param"] == "input[1].call_id", orphan.text
    assert "zz" in orphan.json()["error"]["message"]
    assert sent.status_code == 200 and sent.json()["status"] in ("completed", "incomplete"), sent.text
    assert chat.status_code == 200, chat.text
