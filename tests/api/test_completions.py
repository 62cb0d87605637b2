"""Legacy /v1/completions: string and token-list prompts, stream and non-stream, legacy logprobs."""

from __future__ import annotations

import pytest

from .conftest import MODEL, REPLY, run, serve, sse_json


def test_string_prompt_non_stream():
    async def main():
        async with serve() as s:
            r = await s.client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello"})
            return r, s.engine, s.tokenizer

    r, engine, tok = run(main())
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    ids = tok.encode(REPLY)
    assert body["choices"] == [{"index": 0, "text": REPLY, "logprobs": None, "finish_reason": "stop"}]
    prompt = tok.encode("Hello")
    assert engine.submitted[0][1] == prompt
    assert engine.submitted[0][2].max_tokens == 16  # OpenAI's default for completions
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(ids) + 1,
                             "total_tokens": len(prompt) + len(ids) + 1,
                             "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.parametrize("prompt", [[5, 6, 7], [[5, 6, 7]]])
def test_token_prompt_stream(prompt):
    async def main():
        async with serve() as s:
            r = await s.client.post(
                "/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": prompt,
                    "max_tokens": 4,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
            return r, s.engine, s.tokenizer

    r, engine, tok = run(main())
    assert engine.submitted[0][1] == [5, 6, 7]
    chunks = sse_json(r.content)
    assert all(c["object"] == "text_completion" for c in chunks)
    *body, usage = chunks
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 4,
                                                         "total_tokens": 7,
                                                         "prompt_tokens_details": {"cached_tokens": 0}}
    assert "".join(c["choices"][0]["text"] for c in body) == tok.decode(tok.encode(REPLY)[:4])
    assert body[-1]["choices"][0] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
    assert all(c["choices"][0]["finish_reason"] is None for c in body[:-1])


def test_legacy_logprobs():
    async def main():
        async with serve() as s:
            body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "logprobs": 2}
            a = await s.client.post("/v1/completions", json=body)
            b = await s.client.post("/v1/completions", json={**body, "stream": True})
            return a, b, s.tokenizer

    a, b, tok = run(main())
    lp = a.json()["choices"][0]["logprobs"]
    ids = tok.encode(REPLY)[:3]
    tokens = [tok.token_text(i) for i in ids]
    assert lp["tokens"] == tokens
    assert lp["token_logprobs"] == [-0.5, -1.0, -1.5]
    assert lp["top_logprobs"] == [
        {tok.token_text(i): -0.5 * (k + 1), tok.token_text(i + 1): -0.5 * (k + 1) - 1}
        for k, i in enumerate(ids)
    ]
    assert lp["text_offset"] == [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]
    chunks = sse_json(b.content)[:-1]
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        for k in streamed:
            streamed[k] += c["choices"][0]["logprobs"][k]
    assert streamed == lp


def test_legacy_logprobs_always_hold_the_sampled_token():
    """OpenAI: the sampled token's logprob is always returned (up to logprobs+1 entries), even for 0."""
    async def main():
        async with serve() as s:
            body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "logprobs": 0}
            return await s.client.post("/v1/completions", json=body), s.tokenizer

    r, tok = run(main())
    ids = tok.encode(REPLY)[:2]
    assert r.json()["choices"][0]["logprobs"]["top_logprobs"] == [
        {tok.token_text(i): -0.5 * (k + 1)} for k, i in enumerate(ids)]


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [1, 10**9]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "hi", "echo": True}, "echo"),
    ({"prompt": "hi", "suffix": "x"}, "suffix"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 500}, "max_tokens"),
])
def test_completion_bad_input(body, param):
    async def main():
        async with serve() as s:
            return await s.client.post("/v1/completions", json={"model": MODEL, **body}), s.engine

    r, engine = run(main())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and not engine.submitted
