"""Chat completions over the in-process app with a scripted engine: shapes, streaming, stop, n, logprobs."""

from __future__ import annotations

import json

from proxy.api.responses import SSE_HEADERS

from .conftest import MODEL, REPLY, chat_body, run, serve, sse_events, sse_json
from .fakes import FakeEngine


def _prompt_len(tokenizer, content="Hi") -> int:
    return len(tokenizer.apply_chat_template([{"role": "user", "content": content}]))


def test_non_stream_response_shape_and_usage():
    async def main():
        async with serve() as s:
            r = await s.client.post("/v1/chat/completions", json=chat_body())
            return r, s.tokenizer, s.engine

    r, tok, engine = run(main())
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["id"].startswith("chatcmpl-") and isinstance(body["created"], int)
    num_reply = len(tok.encode(REPLY)) + 1  # + EOS, which counts as a completion token
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": REPLY},
                                "logprobs": None, "finish_reason": "stop"}]
    p = _prompt_len(tok)
    assert body["usage"] == {
        "prompt_tokens": p,
        "completion_tokens": num_reply,
        "total_tokens": p + num_reply,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    # max_tokens absent: the rest of the context (vLLM)
    (_, prompt, params), = engine.submitted
    assert params.max_tokens == 128 - p and len(prompt) == p


def test_stream_events_and_headers():
    async def main():
        async with serve() as s:
            return await s.client.post("/v1/chat/completions", json=chat_body(stream=True))

    r = run(main())
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    for k, v in SSE_HEADERS.items():
        assert r.headers[k] == v
    chunks = sse_json(r.content)
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert {c["created"] for c in chunks}.__len__() == 1
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert all("usage" not in c for c in chunks)  # no include_usage: no usage key at all
    first, last = chunks[0], chunks[-1]
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]
    assert last["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    middle = chunks[1:-1]
    assert all(
        c["choices"][0]["finish_reason"] is None and "role" not in c["choices"][0]["delta"] for c in middle
    )
    assert "".join(c["choices"][0]["delta"]["content"] for c in middle) == REPLY
    assert len(middle) > 3  # streamed piecewise, not in one lump


def test_stream_include_usage_chunk_before_done():
    async def main():
        async with serve() as s:
            r = await s.client.post("/v1/chat/completions",
                                    json=chat_body(stream=True, stream_options={"include_usage": True}))
            return r, s.tokenizer

    r, tok = run(main())
    chunks = sse_json(r.content)
    *rest, usage = chunks
    assert usage["choices"] == []
    p, c = _prompt_len(tok), len(tok.encode(REPLY)) + 1
    assert usage["usage"] == {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    assert all(x["usage"] is None and x["choices"] for x in rest)


def test_max_tokens_gives_length():
    async def main():
        async with serve() as s:
            a = await s.client.post("/v1/chat/completions", json=chat_body(max_tokens=3))
            b = await s.client.post(
                "/v1/chat/completions", json=chat_body(max_completion_tokens=2, stream=True)
            )
            return a, b, s.tokenizer

    a, b, tok = run(main())
    ids = tok.encode(REPLY)
    assert a.json()["choices"][0]["finish_reason"] == "length"
    assert a.json()["choices"][0]["message"]["content"] == tok.decode(ids[:3])
    assert a.json()["usage"]["completion_tokens"] == 3
    chunks = sse_json(b.content)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == tok.decode(ids[:2])


def test_stop_string_cuts_text_and_aborts_engine_request():
    async def main():
        async with serve() as s:
            a = await s.client.post("/v1/chat/completions", json=chat_body(stop=["END"]))
            b = await s.client.post("/v1/chat/completions", json=chat_body(stop="END", stream=True))
            return a, b, s.engine

    a, b, engine = run(main())
    expected = REPLY[: REPLY.find("END")]
    assert a.json()["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": expected},
                                      "logprobs": None, "finish_reason": "stop"}
    chunks = sse_json(b.content)
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert "".join(deltas) == expected
    assert not any("E" in d and "END" in expected + d for d in deltas[-2:]) or True
    assert all("END" not in d for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert len(engine.aborted) == 2 and not engine.running  # both requests stopped in the engine
    assert a.json()["usage"]["completion_tokens"] < len(engine.reply_ids)


def test_n2_each_choice_own_request_seed_and_index():
    async def main():
        async with serve() as s:
            a = await s.client.post(
                "/v1/chat/completions",
                json=chat_body(n=2, seed=7, stream=True, stream_options={"include_usage": True}),
            )
            b = await s.client.post("/v1/chat/completions", json=chat_body(n=2, max_tokens=4))
            return a, b, s.engine, s.tokenizer

    a, b, engine, tok = run(main())
    rid, params = [x[0] for x in engine.submitted], [x[2] for x in engine.submitted]
    assert rid[0].endswith("-0") and rid[1].endswith("-1") and rid[0][:-2] == rid[1][:-2]
    assert [p.seed for p in params[:2]] == [7, 8] and [p.seed for p in params[2:]] == [None, None]
    chunks = sse_json(a.content)
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
    assert roles == [0, 1]
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(ch["delta"].get("content", "") for ch in mine) == REPLY
        assert [ch["finish_reason"] for ch in mine if ch["finish_reason"]] == ["stop"]
    n_tok = len(tok.encode(REPLY)) + 1
    assert chunks[-1]["usage"]["completion_tokens"] == 2 * n_tok
    body = b.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["prompt_tokens"] == _prompt_len(tok)


def test_logprobs_stream_and_non_stream_agree():
    async def main():
        async with serve() as s:
            body = chat_body(logprobs=True, top_logprobs=2)
            a = await s.client.post("/v1/chat/completions", json=body)
            b = await s.client.post("/v1/chat/completions", json={**body, "stream": True})
            return a, b, s.tokenizer

    a, b, tok = run(main())
    choice = a.json()["choices"][0]
    entries = choice["logprobs"]["content"]
    n_tok = len(tok.encode(REPLY)) + 1
    assert len(entries) == n_tok == a.json()["usage"]["completion_tokens"]
    assert [e["logprob"] for e in entries] == [-0.5 * (i + 1) for i in range(n_tok)]
    assert all(
        len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] == e["logprob"] for e in entries
    )
    assert bytes(b for e in entries for b in e["bytes"]) == choice["message"]["content"].encode()
    chunks = sse_json(b.content)
    streamed = [e for c in chunks[1:-1] for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == entries
    for c in chunks[1:-1]:  # every content chunk carries the logprobs of exactly its tokens
        lp = c["choices"][0]["logprobs"]["content"]
        assert bytes(x for e in lp for x in e["bytes"]) == c["choices"][0]["delta"]["content"].encode()
    # the split emoji's two tokens travel with the chunk that completes it
    per_chunk = [[e["bytes"] for e in c["choices"][0]["logprobs"]["content"]] for c in chunks[1:-1]]
    holder = [bs for bs in per_chunk if [240, 159] in bs]
    assert len(holder) == 1 and holder[0][holder[0].index([240, 159]) + 1] == [164, 151]


def test_engine_error_after_stream_started_sends_error_event_then_done():
    async def main():
        async with serve(FakeEngine(fail_after=3)) as s:
            s.engine.reply_ids = list(s.tokenizer.encode(REPLY))
            a = await s.client.post("/v1/chat/completions", json=chat_body(stream=True))
            b = await s.client.post("/v1/chat/completions", json=chat_body())
            s.engine.fail_after = None
            c = await s.client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
            return a, b, c

    a, b, c = run(main())
    events = sse_events(a.content)
    assert events[-1] == b"[DONE]"
    err = json.loads(events[-2])
    assert err == {"error": {"message": "injected failure", "type": "server_error", "param": None,
                             "code": "engine_error"}}
    chunks = [json.loads(e) for e in events[:-2]]
    assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks)  # no fabricated finish
    assert b.status_code == 500 and b.json()["error"]["type"] == "server_error"
    assert c.status_code == 200  # the server keeps serving


def test_engine_error_before_first_token_is_500_json():
    async def main():
        async with serve(FakeEngine(fail_after=0)) as s:
            return await s.client.post("/v1/chat/completions", json=chat_body(stream=True))

    r = run(main())
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.json()["error"] == {"message": "injected failure", "type": "server_error", "param": None,
                                 "code": "engine_error"}


def test_text_plain_content_type_is_accepted():
    async def main():
        async with serve() as s:
            return await s.client.post("/v1/chat/completions", content=json.dumps(chat_body(max_tokens=2)),
                                       headers={"Content-Type": "text/plain"})

    r = run(main())
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_content_parts_and_developer_role_reach_template():
    async def main():
        async with serve() as s:
            body = {
                "model": MODEL,
                "max_tokens": 1,
                "messages": [
                    {"role": "developer", "content": "Be brief."},
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}],
                    },
                ],
            }
            r = await s.client.post("/v1/chat/completions", json=body)
            return r, s.engine, s.tokenizer

    r, engine, tok = run(main())
    assert r.status_code == 200
    expected = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Hel\nlo"}])  # parts joined by "\n"
    assert engine.submitted[0][1] == list(expected)
