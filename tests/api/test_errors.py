"""The bad-input table (issue 4, case C28): every malformed request gets its status and error type."""

from __future__ import annotations

import json

import pytest

from .conftest import MODEL, chat_body, run, serve

U = [{"role": "user", "content": "hi"}]

# (name, body, status, param) for POST /v1/chat/completions; each is also sent with stream=true.
CHAT_CASES = [
    (
        "unknown role",
        {"model": MODEL, "messages": [{"role": "xyz", "content": "hi"}]},
        400,
        "messages[0].role",
    ),
    ("role not a string", {"model": MODEL, "messages": [{"role": 0, "content": 0}]}, 400, "messages[0].role"),
    ("missing role", {"model": MODEL, "messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    (
        "content wrong type",
        {"model": MODEL, "messages": [{"role": "user", "content": 0}]},
        400,
        "messages[0].content",
    ),
    ("missing content", {"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("empty messages", {"model": MODEL, "messages": []}, 400, "messages"),
    ("messages null item", {"model": MODEL, "messages": [None]}, 400, "messages[0]"),
    ("messages missing", {"model": MODEL}, 400, "messages"),
    ("messages not array", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    (
        "text part not string",
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": 0}]}]},
        400,
        "messages[0].content[0].text",
    ),
    (
        "image part",
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages[0].content[0].type",
    ),
    (
        "tool role without tool_call_id",
        {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]},
        400,
        "messages[0].tool_call_id",
    ),
    ("max_tokens -1", {"model": MODEL, "messages": U, "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens 0", {"model": MODEL, "messages": U, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens string", {"model": MODEL, "messages": U, "max_tokens": "5"}, 400, "max_tokens"),
    (
        "max_completion_tokens 0",
        {"model": MODEL, "messages": U, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    ("temperature -3", {"model": MODEL, "messages": U, "temperature": -3}, 400, "temperature"),
    ("temperature 2.5", {"model": MODEL, "messages": U, "temperature": 2.5}, 400, "temperature"),
    ("temperature string", {"model": MODEL, "messages": U, "temperature": "hot"}, 400, "temperature"),
    ("top_p negative", {"model": MODEL, "messages": U, "top_p": -0.01}, 400, "top_p"),
    ("top_p 1.5", {"model": MODEL, "messages": U, "top_p": 1.5}, 400, "top_p"),
    ("n 0", {"model": MODEL, "messages": U, "n": 0}, 400, "n"),
    ("n too big", {"model": MODEL, "messages": U, "n": 1000}, 400, "n"),
    (
        "top_logprobs 21",
        {"model": MODEL, "messages": U, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    (
        "top_logprobs without logprobs",
        {"model": MODEL, "messages": U, "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    ("logit_bias 101", {"model": MODEL, "messages": U, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("logit_bias bad key", {"model": MODEL, "messages": U, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    (
        "logit_bias id outside vocab",
        {"model": MODEL, "messages": U, "logit_bias": {"999999": 1}},
        400,
        "logit_bias",
    ),
    ("presence_penalty 3", {"model": MODEL, "messages": U, "presence_penalty": 3}, 400, "presence_penalty"),
    (
        "frequency_penalty -3",
        {"model": MODEL, "messages": U, "frequency_penalty": -3},
        400,
        "frequency_penalty",
    ),
    ("stop wrong type", {"model": MODEL, "messages": U, "stop": 5}, 400, "stop"),
    ("stop list of ints", {"model": MODEL, "messages": U, "stop": [5]}, 400, "stop"),
    ("seed string", {"model": MODEL, "messages": U, "seed": "x"}, 400, "seed"),
    ("seed 2**63", {"model": MODEL, "messages": U, "seed": 2**63}, 400, "seed"),
    ("seed below -2**63", {"model": MODEL, "messages": U, "seed": -(2**63) - 1}, 400, "seed"),
    ("stream not bool", {"model": MODEL, "messages": U, "stream": "yes"}, 400, "stream"),
    ("tool_choice", {"model": MODEL, "messages": U, "tool_choice": "auto"}, 400, "tool_choice"),
    (
        "response_format json",
        {"model": MODEL, "messages": U, "response_format": {"type": "json_object"}},
        400,
        "response_format",
    ),
    ("audio", {"model": MODEL, "messages": U, "audio": {"voice": "x"}}, 400, "audio"),
    ("model not string", {"model": 5, "messages": U}, 400, "model"),
    ("unknown model", {"model": "gpt-9", "messages": U}, 404, "model"),
    ("max_tokens over context", {"model": MODEL, "messages": U, "max_tokens": 10_000_000}, 400, "max_tokens"),
    (
        "prompt over context",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 300}]},
        400,
        "messages",
    ),
    (
        "min_tokens over max_tokens",
        {"model": MODEL, "messages": U, "max_tokens": 3, "min_tokens": 5},
        400,
        "min_tokens",
    ),
    ("best_of on chat", {"model": MODEL, "messages": U, "best_of": 2}, 400, "best_of"),
    # lone UTF-16 surrogate escapes are valid JSON but no Unicode text (httpx sends them as "\ud83d")
    ("lone surrogate in model", {"model": "\ud83d", "messages": U}, 400, "model"),
    (
        "lone surrogate in content",
        {"model": MODEL, "messages": [{"role": "user", "content": "\ud800 hi"}]},
        400,
        "messages[0].content",
    ),
    (
        "lone surrogate in part type",
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "\ud800"}]}]},
        400,
        "messages[0].content[0].type",
    ),
    ("lone surrogate in stop", {"model": MODEL, "messages": U, "stop": ["ok", "\udfff"]}, 400, "stop[1]"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("name", "body", "status", "param"), CHAT_CASES, ids=[c[0] for c in CHAT_CASES])
def test_chat_bad_input(name, body, status, param, stream):
    async def main():
        async with serve() as s:
            sent = dict(body)
            if stream:
                sent["stream"] = body.get("stream", True)
            # json.dumps escapes non-ASCII (and lone surrogates) as \\uXXXX, as many clients send them
            r = await s.client.post("/v1/chat/completions", content=json.dumps(sent),
                                    headers={"Content-Type": "application/json"})
            ok = await s.client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
            return r, ok, s.engine

    r, ok, engine = run(main())
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"
    assert isinstance(err["message"], str) and err["message"] and "Traceback" not in err["message"]
    assert "/" not in err["message"] or "Authorization" in err["message"]
    assert len(engine.submitted) == 1  # nothing was scheduled for the bad request
    assert ok.status_code == 200  # and the server still serves


def test_a_missing_model_is_the_one_model():
    """Without ``model`` a one-model server serves its model (vLLM, llama.cpp's server) on every endpoint
    that names one, and answers with the model's id; a several-model server's 400 is
    tests/api/test_models_registry.py's."""
    async def main():
        async with serve() as s:
            chat = await s.client.post("/v1/chat/completions", json={"messages": U, "max_tokens": 2})
            text = await s.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            stream = await s.client.post("/v1/chat/completions",
                                         json={"messages": U, "max_tokens": 2, "stream": True})
            message = await s.client.post("/v1/messages", json={"messages": U, "max_tokens": 2})
            tokens = await s.client.post("/tokenize", json={"prompt": "hi"})
            return chat, text, stream, message, tokens

    chat, text, stream, message, tokens = run(main())
    assert [r.status_code for r in (chat, text, stream, message, tokens)] == [200] * 5, chat.text
    assert chat.json()["model"] == text.json()["model"] == message.json()["model"] == MODEL
    assert f'"model":"{MODEL}"' in stream.text.replace(" ", "")
    assert tokens.json()["count"] == len(tokens.json()["tokens"]) > 0


def test_context_length_message_gives_the_numbers():
    async def main():
        async with serve() as s:
            a = await s.client.post("/v1/chat/completions", json=chat_body(max_tokens=200, stream=True))
            b = await s.client.post("/v1/chat/completions", json=chat_body("hi " * 300))
            return a, b, len(s.tokenizer.apply_chat_template(
                [{"role": "user", "content": "Hi"}])), len(s.tokenizer.apply_chat_template(
                    [{"role": "user", "content": "hi " * 300}]))

    a, b, p, big = run(main())
    assert a.status_code == 400 and a.headers["content-type"] == "application/json"
    assert a.json()["error"] == {
        "message": f"This model's maximum context length is 128 tokens. However, you requested {p + 200} "
        "tokens "
        f"({p} in the messages, 200 in the completion). Please reduce the length of the messages "
        "or the completion.",
        "type": "invalid_request_error",
        "param": "max_tokens",
        "code": "context_length_exceeded",
    }
    assert b.json()["error"]["code"] == "context_length_exceeded"
    assert (
        f"you requested {big + 1} tokens ({big} in the messages, 1 in the completion)"
        in b.json()["error"]["message"]
    )


@pytest.mark.parametrize(("raw", "needle"), [
    (b'{"model":"test-model","messages":[{"role":"user","content":"\xff\xfe"}]}', "UTF-8"),
    (b"this is not json", "not valid JSON"),
    (b"", "empty"),
    (b"[1, 2]", "JSON object"),
    (b'{"model": "test-model", "messages": [', "not valid JSON"),
    (b"[" * 100000 + b"]" * 100000, "nested"),
])
def test_undecodable_bodies_are_400(raw, needle):
    async def main():
        async with serve() as s:
            return await s.client.post("/v1/chat/completions", content=raw,
                                       headers={"Content-Type": "application/json"})

    r = run(main())
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and needle in err["message"]


def test_body_over_limit_is_413_by_header_and_by_stream():
    async def main():
        async with serve(max_body_bytes=1000) as s:
            big = json.dumps(chat_body("x" * 5000)).encode()
            a = await s.client.post("/v1/chat/completions", content=big)

            async def chunks():
                for _ in range(10):
                    yield b" " * 500
            b = await s.client.post("/v1/chat/completions", content=chunks())  # no Content-Length
            return a, b

    a, b = run(main())
    for r in (a, b):
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "payload_too_large"


def test_unknown_route_and_wrong_method():
    async def main():
        async with serve() as s:
            return (await s.client.get("/v1/nope"), await s.client.get("/v1/chat/completions"),
                    await s.client.post("/v1/models"))

    nope, get_chat, post_models = run(main())
    assert nope.status_code == 404 and nope.json()["error"]["code"] == "not_found"
    assert get_chat.status_code == 405 and get_chat.json()["error"]["code"] == "method_not_allowed"
    assert "POST" in get_chat.headers["allow"]
    assert post_models.status_code == 405


def test_unknown_extra_fields_are_ignored_and_harmless_nulls_accepted():
    async def main():
        async with serve() as s:
            return await s.client.post("/v1/chat/completions", json=chat_body(
                max_tokens=2, foo="bar", store=False, metadata={"a": "b"}, tools=None, tool_choice="none",
                response_format={"type": "text"}, user="u1", top_k=5, min_p=0.1, repetition_penalty=1.1,
                ignore_eos=True, stream_options=None))

    r = run(main())
    assert r.status_code == 200, r.text


def test_stream_options_without_stream_is_400():
    async def main():
        async with serve() as s:
            return await s.client.post("/v1/chat/completions",
                                       json=chat_body(stream_options={"include_usage": True}))

    r = run(main())
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_rate_limit_is_429():
    from .fakes import FakeEngine

    async def main():
        async with serve(FakeEngine(max_waiting=0)) as s:
            return await s.client.post("/v1/chat/completions", json=chat_body(stream=True))

    r = run(main())
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"


def test_api_key_required_when_configured():
    async def main():
        async with serve(api_keys=("k1",)) as s:
            a = await s.client.post("/v1/chat/completions", json=chat_body(max_tokens=1))
            b = await s.client.post("/v1/chat/completions", json=chat_body(max_tokens=1),
                                    headers={"Authorization": "Bearer k1"})
            c = await s.client.get("/health")
            return a, b, c

    a, b, c = run(main())
    assert a.status_code == 401 and a.json()["error"]["code"] == "invalid_api_key"
    assert b.status_code == 200 and c.status_code == 200


def test_completions_lone_surrogate_prompt_is_400_json():
    async def main():
        async with serve() as s:
            body = json.dumps({"model": MODEL, "prompt": "\udfff", "max_tokens": 2})
            return await s.client.post(
                "/v1/completions", content=body, headers={"Content-Type": "application/json"}
            )

    r = run(main())
    assert r.status_code == 400
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["type"] == "invalid_request_error"
