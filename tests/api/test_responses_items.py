"""Responses API items by id (in-process app, FakeEngine): an ``item_reference`` resolves to the stored
item with that id (an output message, a function call, an input item) and prompts exactly as the same
item sent inline; an unknown, deleted or never-stored id is a 400 naming ``input[i].id``. The store's
item index follows put, delete and eviction. ``GET /v1/responses/{id}/input_items`` lists items in
OpenAI's shapes (each validates strictly against the openai-python type), with unique ids, paged by
``order`` / ``limit`` / ``after`` / ``before``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from openai import AsyncOpenAI
from openai.types.responses import (
    ResponseFunctionToolCallItem,
    ResponseFunctionToolCallOutputItem,
    ResponseInputMessageItem,
    ResponseOutputMessage,
    ResponseReasoningItem,
)
from pydantic import BaseModel

from proxy.api.responses_api.store import ResponseStore

from .conftest import MODEL, REPLY, Served, reply_ids, run, serve
from .fakes import FakeEngine, make_tokenizer

TOOL = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


async def _prompt(s: Served, body: dict[str, Any]) -> list[int]:
    """The prompt ids the engine was given for ``body`` (POST /v1/responses, 200), checked equal in
    length to what ``/v1/responses/input_tokens`` counts for the same body."""
    r = await s.client.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 2, **body})
    assert r.status_code == 200, r.text
    counted = await s.client.post("/v1/responses/input_tokens", json={"model": MODEL, **body})
    assert counted.status_code == 200, counted.text
    prompt = s.engine.submitted[-1][1]
    assert counted.json()["input_tokens"] == len(prompt)
    return prompt


def test_a_referenced_message_prompts_as_the_message_inline() -> None:
    async def main() -> None:
        async with serve(max_model_len=2048) as s:
            first = (await s.client.post("/v1/responses", json={"model": MODEL, "input": "hi"})).json()
            message = first["output"][0]
            assert message["type"] == "message" and message["content"][0]["text"] == REPLY
            listed = (await s.client.get(f"/v1/responses/{first['id']}/input_items")).json()
            user_id = listed["data"][0]["id"]
            more = {"role": "user", "content": "more"}
            inline = await _prompt(s, {"input": [{"role": "user", "content": "hi"}, message, more]})
            referenced = await _prompt(s, {"input": [{"type": "item_reference", "id": user_id},
                                                     {"type": "item_reference", "id": message["id"]}, more]})
            without = await _prompt(s, {"input": [{"role": "user", "content": "hi"}, more]})
            assert referenced == inline and len(inline) > len(without)

    run(main())


def test_a_referenced_function_call_pairs_with_its_output() -> None:
    async def main() -> None:
        tokenizer = make_tokenizer()
        engine = FakeEngine(reply_ids=reply_ids(tokenizer, HERMES))
        async with serve(engine, tool_call_parser="hermes", max_model_len=2048) as s:
            first = (await s.client.post("/v1/responses", json={
                "model": MODEL, "input": "Weather in Oslo?", "tools": [TOOL]})).json()
            call = first["output"][-1]
            assert call["type"] == "function_call" and call["id"].startswith("fc_"), first
            engine.reply_ids = reply_ids(tokenizer)
            output = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
            question = {"role": "user", "content": "Weather in Oslo?"}
            inline = await _prompt(s, {"tools": [TOOL], "input": [question, call, output]})
            referenced = await _prompt(s, {"tools": [TOOL], "input": [
                question, {"type": "item_reference", "id": call["id"]}, output]})
            assert referenced == inline
            orphan = await s.client.post("/v1/responses", json={"model": MODEL, "input": [question, output]})
            assert orphan.status_code == 400 and orphan.json()["error"]["param"] == "input[1].call_id"

    run(main())


def test_an_unknown_item_reference_is_a_400_naming_its_id() -> None:
    async def main() -> None:
        async with serve() as s:
            first = (await s.client.post("/v1/responses", json={"model": MODEL, "input": "hi"})).json()
            msg_id = first["output"][0]["id"]
            assert (await s.client.delete(f"/v1/responses/{first['id']}")).status_code == 200
            for ref in ("msg_nope", msg_id, 7):
                body = {"model": MODEL, "input": [{"role": "user", "content": "hi"},
                                                  {"type": "item_reference", "id": ref}]}
                for path in ("/v1/responses", "/v1/responses/input_tokens"):
                    r = await s.client.post(path, json=body)
                    assert r.status_code == 400, r.text
                    err = r.json()["error"]
                    assert err["param"] == "input[1].id" and err["type"] == "invalid_request_error", err
                    if isinstance(ref, str):
                        assert ref in err["message"] and "not found" in err["message"], err
        async with serve(responses_store_max_entries=0) as off:
            first = (await off.client.post("/v1/responses", json={"model": MODEL, "input": "hi"})).json()
            r = await off.client.post("/v1/responses", json={"model": MODEL, "input": [
                {"type": "item_reference", "id": first["output"][0]["id"]}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].id", r.text

    run(main())


def test_the_item_index_follows_put_delete_and_eviction() -> None:
    def response(i: int) -> dict[str, Any]:
        return {"id": f"resp_{i}", "output": [{"id": f"msg_out{i}"}]}

    store = ResponseStore(max_entries=2, max_bytes=1 << 20)
    shared = {"id": "msg_shared", "role": "user", "content": "a"}
    store.put(response(0), [shared, {"id": "msg_out0"}])
    store.put(response(1), [shared, {"id": "msg_out1"}, {"type": "message"}])
    assert store.item("msg_shared") == shared and store.item("msg_out0") == {"id": "msg_out0"}
    store.put(response(2), [{"id": "msg_out2"}])  # evicts resp_1: item() made resp_0 the most recent
    assert store.get("resp_1") is None and store.item("msg_out1") is None
    assert store.item("msg_shared") == shared  # resp_0 still holds it
    assert store.delete("resp_0") and store.item("msg_shared") is None and store.item("msg_out0") is None
    assert store.item("msg_out2") == {"id": "msg_out2"}


def _sdk_type(item: dict[str, Any]) -> type[BaseModel]:
    if item["type"] == "message":
        return ResponseOutputMessage if item["role"] == "assistant" else ResponseInputMessageItem
    return {"function_call": ResponseFunctionToolCallItem, "reasoning": ResponseReasoningItem,
            "function_call_output": ResponseFunctionToolCallOutputItem}[item["type"]]


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Call it."}]},
    {"role": "assistant", "content": "Let me look."},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Answer now."}]},
]


def test_input_items_have_openai_shapes_and_unique_ids() -> None:
    async def main() -> tuple[list[Any], list[dict[str, Any]], list[dict[str, Any]]]:
        async with serve(max_model_len=2048) as s:
            r = await s.client.post("/v1/responses", json={"model": MODEL, "input": CONVERSATION})
            assert r.status_code == 200, r.text
            again = await s.client.post("/v1/responses", json={"model": MODEL, "input": CONVERSATION})
            sdk = AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=s.client)
            page = await sdk.responses.input_items.list(r.json()["id"], order="asc")
            raw = (await s.client.get(f"/v1/responses/{r.json()['id']}/input_items?order=asc")).json()
            other = (await s.client.get(f"/v1/responses/{again.json()['id']}/input_items")).json()
            return page.data, raw["data"], other["data"]

    parsed, raw, other = run(main())
    assert [i.type for i in parsed] == [i.get("type", "message") for i in CONVERSATION]
    for item in raw:
        model = _sdk_type(item).model_validate(item, strict=True)
        assert not model.model_extra, (item, model.model_extra)  # no field the SDK type lacks
        assert item.get("status", "completed") == "completed"
    assert raw[0]["content"] == [{"type": "input_text", "text": "Be brief."}]
    assert raw[0]["id"].startswith("msg_") and raw[4]["id"].startswith("fc_")
    assert raw[3]["content"] == [{"type": "output_text", "text": "Let me look.", "annotations": []}]
    assert (raw[4]["call_id"], raw[4]["name"], raw[5]["output"]) == ("call_1", "get_weather", "sunny")
    ids = [i["id"] for i in raw] + [i["id"] for i in other]
    assert len(set(ids)) == len(ids) == 2 * len(CONVERSATION)


def test_input_items_page_by_order_limit_after_before() -> None:
    async def main() -> tuple[list[str], dict[str, Any]]:
        async with serve(max_model_len=2048) as s:
            input_ = [{"role": "user", "content": str(i)} for i in range(25)]
            rid = (await s.client.post("/v1/responses", json={"model": MODEL, "input": input_})).json()["id"]

            async def get(query: str) -> Any:
                return await s.client.get(f"/v1/responses/{rid}/input_items{query}")

            full = (await get("?order=asc&limit=100")).json()
            ids = [i["id"] for i in full["data"]]
            assert [i["content"][0]["text"] for i in full["data"]] == [str(i) for i in range(25)]
            default = (await get("")).json()  # desc, 20
            assert [i["id"] for i in default["data"]] == ids[::-1][:20] and default["has_more"] is True
            assert (default["first_id"], default["last_id"]) == (ids[24], ids[5])
            nxt = (await get(f"?after={default['last_id']}")).json()
            assert [i["id"] for i in nxt["data"]] == ids[4::-1] and nxt["has_more"] is False
            asc = (await get(f"?order=asc&limit=3&after={ids[1]}")).json()
            assert [i["id"] for i in asc["data"]] == ids[2:5] and asc["has_more"] is True
            before = (await get(f"?order=asc&before={ids[3]}")).json()
            assert [i["id"] for i in before["data"]] == ids[:3] and before["has_more"] is False
            errors = {}
            for query in ("?limit=0", "?limit=101", "?limit=x", "?order=up", "?after=msg_nope"):
                r = await get(query)
                assert r.status_code == 400, (query, r.text)
                errors[query] = r.json()["error"]["param"]
            return ids, errors

    ids, errors = run(main())
    assert len(set(ids)) == 25
    assert errors == {"?limit=0": "limit", "?limit=101": "limit", "?limit=x": "limit", "?order=up": "order",
                      "?after=msg_nope": "after"}


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_a_continued_response_lists_the_earlier_items_with_their_ids(order: str) -> None:
    async def main() -> tuple[dict[str, Any], dict[str, Any]]:
        async with serve(max_model_len=2048) as s:
            first = (await s.client.post("/v1/responses", json={"model": MODEL, "input": "hi"})).json()
            second = (await s.client.post("/v1/responses", json={
                "model": MODEL, "input": "more", "previous_response_id": first["id"]})).json()
            a = (await s.client.get(f"/v1/responses/{first['id']}/input_items?order={order}")).json()
            b = (await s.client.get(f"/v1/responses/{second['id']}/input_items?order={order}")).json()
            return a, {**b, "output_id": first["output"][0]["id"]}

    a, b = run(main())
    ids = [i["id"] for i in b["data"]]
    expected = [a["data"][0]["id"], b["output_id"]]
    assert (ids[:2] if order == "asc" else ids[:0:-1]) == expected and len(ids) == 3


def test_a_reasoning_item_sent_back_gives_its_text_once() -> None:
    """Our reasoning items carry the reasoning as ``content`` and again as ``summary``: sent back
    (inline, by reference or through ``previous_response_id``) the assistant turn's reasoning is the
    text once; an item with a summary only gives the summary; a part list of the wrong type is a
    400 naming it (it was a TypeError, a 500)."""
    from proxy.errors import InvalidRequestError
    from proxy.protocol.responses_items import chat_messages

    thought = {"type": "reasoning", "id": "rs_1", "content": [{"type": "reasoning_text", "text": "Hmm."}],
               "summary": [{"type": "summary_text", "text": "Hmm."}]}
    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi"}]}
    user = {"type": "message", "role": "user", "content": "hello"}
    got = chat_messages([user, thought, answer], None)
    assert got[-1]["role"] == "assistant" and got[-1]["reasoning_content"] == "Hmm."
    summary_only = {**thought, "content": None, "summary": [{"type": "summary_text", "text": "Short."}]}
    assert chat_messages([user, summary_only, answer], None)[-1]["reasoning_content"] == "Short."
    with pytest.raises(InvalidRequestError) as info:
        chat_messages([user, {**thought, "summary": "Hmm."}, answer], None)
    assert info.value.param == "input[1].summary"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_stored_response_is_visible_in_progress_and_dropped_when_its_client_leaves(stream: bool) -> None:
    """``GET /v1/responses/{id}`` while the response is generated answers it ``in_progress`` (as
    OpenAI's); continuing it then is a 400 (its output is not there yet); finished, it is the final
    response. A request whose client goes away before the end is not kept (404 after)."""
    async def main() -> None:
        tok = make_tokenizer()
        ids = list(tok.encode("alpha beta " * 80))  # a window of ~1.6 s to look in
        engine = FakeEngine(script=lambda prompt, params: ids, step_s=0.01)
        async with serve(engine, max_model_len=4096) as s:
            body = {"model": MODEL, "input": "hi", "max_output_tokens": len(ids), "stream": stream}

            async def running_id() -> str:
                while not engine.running:
                    await asyncio.sleep(0.005)
                return next(iter(engine.running)).rsplit("-", 1)[0]

            task = asyncio.create_task(s.client.post("/v1/responses", json=body))
            response_id = await running_id()
            now = await s.client.get(f"/v1/responses/{response_id}")
            assert now.status_code == 200 and now.json()["status"] == "in_progress", now.text
            assert now.json()["output"] == []
            follow = await s.client.post("/v1/responses", json={"model": MODEL, "input": "and?",
                                                                "previous_response_id": response_id})
            assert follow.status_code == 400 and follow.json()["error"]["param"] == "previous_response_id"
            await task
            done = await s.client.get(f"/v1/responses/{response_id}")
            assert done.status_code == 200 and done.json()["status"] == "incomplete"
            assert done.json()["output"][0]["content"][0]["text"] == tok.decode(ids)

            task = asyncio.create_task(s.client.post("/v1/responses", json=body))
            response_id = await running_id()
            assert (await s.client.get(f"/v1/responses/{response_id}")).status_code == 200
            task.cancel()  # the client goes away
            with pytest.raises(asyncio.CancelledError):
                await task
            while engine.running:
                await asyncio.sleep(0.005)
            gone = await s.client.get(f"/v1/responses/{response_id}")
            assert gone.status_code == 404

    run(main())
