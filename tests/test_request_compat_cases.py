"""Request compatibility with what OpenAI clients send, against a real default-model server: every line of
tests/data/cases/round2_public.jsonl (C29a..C40b): the ``developer`` role, content-part arrays,
``max_completion_tokens``, the forms of ``stop``, ``top_p`` 0, ``logit_bias`` and the penalties, a
chat template that raises (400, not 500), bodies with a byte-order mark or gzip-encoded.


One parametrized test per case id asserts that case's whole ``check`` text (write-ups in
``tests/data/cases/log.md``). ``MODEL`` is replaced by the served id; the requests a check compares
run concurrently (the engine batches them); T0 comparisons are exact (content, prompt_tokens,
logprobs). Token ids of C34 are those of the default model (SmolLM2-135M-Instruct): 19556 is
``Hello``, 2 is the EOS ``<|im_end|>``.

C37a/b need a chat template that raises: a second server serves a temporary copy of the default
model's converted folder (weights symlinked) whose ``chat_template.jinja`` raises on a leading
system message and on non-alternating user/assistant turns (Gemma/Mistral style), as the cases'
``note`` describes.
"""

from __future__ import annotations

import asyncio
import atexit
import gzip
import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e.server import Server, get_server
from test_cases import call, finish_of, joined, with_model
from testdata import ROUND2_PUBLIC

from proxy.ports import start_serve, stop
from proxy.quant import cpu_bf16_flags

pytestmark = [pytest.mark.slow]

CASES = [json.loads(line) for line in ROUND2_PUBLIC.read_text(encoding="utf-8").splitlines() if line.strip()]
BY_ID = {c["id"]: c for c in CASES}
HELLO_ID = 19556
"""``Hello``: the first token of the unbiased T0 answer to C34a's prompt (default model)."""
PART_SEPARATOR = "\n"
"""How the server joins the text parts of one message (README "Content parts", as vLLM; the C30 check
says "the server's documented separator")."""
EOS_ID = 2
"""``<|im_end|>``, the default model's EOS."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Server:
    return get_server(tmp_path_factory.mktemp("request_compat_cases"))


async def call_path(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST ``body`` to ``path`` (non-stream); status and parsed JSON."""
    r = await client.post(path, json=body)
    return {"status": r.status_code, "headers": r.headers, "json": r.json()}


def run_all(server: Server, jobs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Send every job concurrently. A job is a request body (POST /v1/chat/completions, stream or not
    per its ``stream`` key), ``("/v1/completions", body)``, or ``("raw", bytes, headers)``."""

    async def main() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600,
                                     limits=httpx.Limits(max_connections=32)) as client:
            coros = []
            for job in jobs.values():
                if isinstance(job, dict):
                    coros.append(call(client, job))
                elif job[0] == "raw":
                    coros.append(call(client, None, raw_body=job[1], headers=job[2]))
                else:
                    coros.append(call_path(client, job[0], job[1]))
            return list(await asyncio.gather(*coros))

    return dict(zip(jobs, asyncio.run(main())))


def ok(res: dict[str, Any]) -> dict[str, Any]:
    """The JSON body of a 200 non-stream answer (asserts the status)."""
    assert res["status"] == 200, res.get("json")
    return res["json"]


def content(res: dict[str, Any], i: int = 0) -> str:
    return ok(res)["choices"][i]["message"]["content"]


def streamed(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The chunks of a 200 SSE answer (asserts status, content type and ``[DONE]``)."""
    assert res["status"] == 200, res.get("json")
    assert res["headers"]["content-type"].startswith("text/event-stream")
    assert res["raw"].endswith(b"data: [DONE]\n\n")
    return res["chunks"]


def plain_of(req: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """``req`` as a non-stream request (no ``stream_options``) with ``changes`` applied (None deletes)."""
    out = {k: v for k, v in req.items() if k not in ("stream", "stream_options")}
    for k, v in changes.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def stream_of(req: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return plain_of(req, **changes) | {"stream": True}


def tokens_of(body: dict[str, Any], i: int = 0) -> list[str]:
    return [e["token"] for e in body["choices"][i]["logprobs"]["content"]]


def stream_tokens(chunks: list[dict[str, Any]], i: int = 0) -> list[str]:
    return [e["token"] for c in chunks for ch in c["choices"] if ch["index"] == i and ch.get("logprobs")
            for e in ch["logprobs"]["content"] or []]


def case_request(cid: str, server: Server) -> dict[str, Any]:
    return with_model(BY_ID[cid]["request"], server.model)


def check_c29a(server: Server) -> None:
    req = case_request("C29a", server)
    sys_msgs = [{"role": "system", "content": req["messages"][0]["content"]}, req["messages"][1]]
    mid = [{"role": "user", "content": "Hi."}, {"role": "developer", "content": "Answer in one word."},
           {"role": "user", "content": "What colour is the sky?"}]
    r = run_all(server, {"dev": req, "sys": plain_of(req, messages=sys_msgs),
                         "mid": plain_of(req, messages=mid)})
    dev, sys_ = ok(r["dev"]), ok(r["sys"])
    assert dev["usage"]["prompt_tokens"] == sys_["usage"]["prompt_tokens"]
    assert dev["choices"][0]["message"]["content"] == sys_["choices"][0]["message"]["content"]
    assert content(r["mid"])


def check_c29b(server: Server) -> None:
    req = case_request("C29b", server)
    sys_msgs = [{"role": "system", "content": req["messages"][0]["content"]}, req["messages"][1]]
    r = run_all(server, {"dev": req, "sys": plain_of(req, messages=sys_msgs)})
    assert joined(streamed(r["dev"])) == content(r["sys"])


def check_c30(server: Server) -> None:
    req = case_request("C30", server)
    strings = [{"role": m["role"], "content": PART_SEPARATOR.join(p["text"] for p in m["content"])}
               for m in req["messages"]]
    last_only = [req["messages"][0], {"role": "user", "content": [req["messages"][1]["content"][-1]]}]
    turn = [{"type": "text", "text": "Blue"}, {"type": "text", "text": "."}]
    asst_parts = [*req["messages"], {"role": "assistant", "content": turn},
                  {"role": "user", "content": [{"type": "text", "text": "And "},
                                               {"type": "text", "text": "grass?"}]}]
    asst_str = [*strings, {"role": "assistant", "content": PART_SEPARATOR.join(["Blue", "."])},
                {"role": "user", "content": PART_SEPARATOR.join(["And ", "grass?"])}]
    r = run_all(server, {
        "parts": req, "strings": plain_of(req, messages=strings), "last": plain_of(req, messages=last_only),
        "stream": stream_of(req), "asst_parts": plain_of(req, messages=asst_parts),
        "asst_str": plain_of(req, messages=asst_str),
    })
    parts, strs = ok(r["parts"]), ok(r["strings"])
    assert parts["usage"]["prompt_tokens"] == strs["usage"]["prompt_tokens"]
    assert parts["choices"][0]["message"]["content"] == strs["choices"][0]["message"]["content"]
    assert parts["usage"]["prompt_tokens"] > ok(r["last"])["usage"]["prompt_tokens"]
    assert joined(streamed(r["stream"])) == parts["choices"][0]["message"]["content"]
    ap, as_ = ok(r["asst_parts"]), ok(r["asst_str"])
    assert ap["usage"]["prompt_tokens"] == as_["usage"]["prompt_tokens"]
    assert ap["choices"][0]["message"]["content"] == as_["choices"][0]["message"]["content"]


def check_c31a(server: Server) -> None:
    req = case_request("C31a", server)
    r = run_all(server, {"stream": req, "plain": plain_of(req)})
    chunks = streamed(r["stream"])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert finish_of(chunks) == "length"
    body = ok(r["plain"])
    assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "length"
    assert joined(chunks) == body["choices"][0]["message"]["content"]


def check_c31b(server: Server) -> None:
    req = case_request("C31b", server)
    r = run_all(server, {"both": req, "null": plain_of(req, max_tokens=3) | {"max_completion_tokens": None}})
    for key, n in (("both", 1), ("null", 3)):
        body = ok(r[key])
        assert body["usage"]["completion_tokens"] == n, key
        assert body["choices"][0]["finish_reason"] == "length", key


def check_c32a(server: Server) -> None:
    req = case_request("C32a", server)
    stop = req["stop"]
    assert isinstance(stop, str)
    r = run_all(server, {"plain": req, "stream": stream_of(req), "array": plain_of(req, stop=[stop]),
                         "raw": plain_of(req, stop=None)})
    raw = content(r["raw"])
    expected = raw[: raw.find(stop)] if stop in raw else raw
    for key in ("plain", "array"):
        body = ok(r[key])
        assert body["choices"][0]["message"]["content"] == expected, key
        if stop in raw:
            assert body["choices"][0]["finish_reason"] == "stop", key
    chunks = streamed(r["stream"])
    assert joined(chunks) == expected
    if stop in raw:
        assert finish_of(chunks) == "stop"


def check_no_stop(cid: str, server: Server) -> None:
    req = case_request(cid, server)
    r = run_all(server, {"given": req, "without": plain_of(req, stop=None)})
    assert content(r["given"]) == content(r["without"])


def check_c33(server: Server) -> None:
    req = case_request("C33", server)
    r = run_all(server, {"top_p0": req, "stream": stream_of(req),
                         "t0": plain_of(req, temperature=0, top_p=None),
                         "top_p1": plain_of(req, top_p=1)})
    t0 = content(r["t0"])
    assert content(r["top_p0"]) == t0
    assert joined(streamed(r["stream"])) == t0
    assert content(r["top_p1"]) is not None


def check_c34a(server: Server) -> None:
    req = case_request("C34a", server)
    assert req["logit_bias"] == {str(HELLO_ID): -100}
    sampled = plain_of(req, temperature=1, n=4, seed=1234)
    r = run_all(server, {
        "banned": req, "stream": stream_of(req), "unbiased": plain_of(req, logit_bias=None),
        "sampled": sampled, "forced": plain_of(req, logit_bias={str(HELLO_ID): 100}),
        "not_an_id": plain_of(req, logit_bias={"hello": -100}),
        "outside": plain_of(req, logit_bias={"10000000": -100}),
        "negative": plain_of(req, logit_bias={"-1": -100}),
    })
    unbiased = ok(r["unbiased"])
    hello = tokens_of(unbiased)[0]
    assert hello == "Hello", unbiased  # the unbiased T0 answer starts with the banned token
    banned = ok(r["banned"])
    assert hello not in tokens_of(banned)
    assert banned["choices"][0]["message"]["content"] != unbiased["choices"][0]["message"]["content"]
    chunks = streamed(r["stream"])
    assert joined(chunks) == banned["choices"][0]["message"]["content"]
    assert stream_tokens(chunks) == tokens_of(banned)
    body = ok(r["sampled"])
    assert len(body["choices"]) == 4
    for i in range(4):
        assert hello not in tokens_of(body, i), i
    forced = ok(r["forced"])
    assert tokens_of(forced) == [hello] * req["max_tokens"]
    assert forced["choices"][0]["finish_reason"] == "length"
    for key in ("not_an_id", "outside", "negative"):
        res = r[key]
        assert res["status"] == 400, (key, res["json"])
        err = res["json"]["error"]
        assert err["param"] == "logit_bias" and err["type"] == "invalid_request_error", (key, err)


def check_c34b(server: Server) -> None:
    req = case_request("C34b", server)
    assert req["logit_bias"] == {str(EOS_ID): -100}
    r = run_all(server, {"no_eos": req, "stream": stream_of(req),
                         "forced": plain_of(req, logit_bias={str(EOS_ID): 100}),
                         "forced_stream": stream_of(req, logit_bias={str(EOS_ID): 100})})
    body = ok(r["no_eos"])
    assert body["usage"]["completion_tokens"] == req["max_tokens"]
    assert body["choices"][0]["finish_reason"] == "length"
    chunks = streamed(r["stream"])
    text, want = joined(chunks), body["choices"][0]["message"]["content"]
    assert finish_of(chunks) == "length"
    if cpu_bf16_flags():
        assert text == want
    else:  # the two requests run together: without BF16 instructions (fp32 activations, no
        # batch-invariance promise, README) a near-tie may go another way with the batch or the prefix
        # cache. On a 2-core AVX2 EPYC this prompt's second token is a near-tie ("!" at logprob -1.109,
        # " there" at -1.141, with the int4 kernel's AVX2 variant) and the texts parted there (torch's
        # int4 kernel parted them after 123 characters); the first token leads by 0.36
        assert text[:5] == want[:5], (text, want)
    forced = ok(r["forced"])
    assert forced["choices"][0]["message"]["content"] == ""
    assert forced["choices"][0]["finish_reason"] == "stop" and forced["usage"]["completion_tokens"] == 1
    fchunks = streamed(r["forced_stream"])
    assert joined(fchunks) == "" and finish_of(fchunks) == "stop"


def check_c34c(server: Server) -> None:
    req = case_request("C34c", server)
    assert req["frequency_penalty"] == 2
    comp = {"model": server.model, "prompt": "la la la la la la la la", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "logprobs": 1}
    r = run_all(server, {
        "freq": req, "zero": plain_of(req, frequency_penalty=0) | {"presence_penalty": 0},
        "presence": plain_of(req, frequency_penalty=None, presence_penalty=2),
        "c_freq": ("/v1/completions", comp | {"frequency_penalty": 2}),
        "c_presence": ("/v1/completions", comp | {"presence_penalty": 2}),
        "c_zero": ("/v1/completions", comp | {"frequency_penalty": 0, "presence_penalty": 0}),
    })
    zero = ok(r["zero"])
    # the unpenalised answer repeats a word ('apple apple ...' with int4 prefill, 'more, more, ...' with
    # the dense prefill of AMX CPUs, 'more apple apple apple ...' dense fp32 on an AVX2 CPU: the
    # wording is the model's and the machine's, the repetition is the point)
    words = zero["choices"][0]["message"]["content"].replace(",", " ").split()
    assert max(Counter(words).values()) >= 3, words
    # the six requests run together: on a CPU without BF16 instructions (fp32 activations and
    # attention; no batch-invariance promise, README) a logprob may move in its 7th digit with the
    # batch, far below what a penalty on the prompt's tokens would do (penalty 2: nats)
    tol = 0.0 if cpu_bf16_flags() else 1e-4
    z_first = zero["choices"][0]["logprobs"]["content"][0]
    for key in ("freq", "presence"):
        body = ok(r[key])
        assert body["choices"][0]["message"]["content"] != zero["choices"][0]["message"]["content"], key
        first = body["choices"][0]["logprobs"]["content"][0]
        assert first["token"] == z_first["token"], key
        assert abs(first["logprob"] - z_first["logprob"]) <= tol, key
    c_zero = ok(r["c_zero"])["choices"][0]
    for key in ("c_freq", "c_presence"):
        choice = ok(r[key])["choices"][0]
        assert choice["text"] != c_zero["text"], key
        assert choice["logprobs"]["tokens"][0] == c_zero["logprobs"]["tokens"][0], key
        got, want = choice["logprobs"]["token_logprobs"][0], c_zero["logprobs"]["token_logprobs"][0]
        assert abs(got - want) <= tol, key


def check_c40a(server: Server) -> None:
    case = BY_ID["C40a"]
    raw = bytes.fromhex(case["raw_body_hex"]).replace(b'"MODEL"', json.dumps(server.model).encode())
    assert raw.startswith(b"\xef\xbb\xbf")
    (res,) = run_all(server, {"bom": ("raw", raw, case["headers"])}).values()
    if res["status"] == 200:
        assert res["json"]["choices"][0]["message"]["content"] is not None
    else:
        assert res["status"] == 400, res
        message = res["json"]["error"]["message"]
        assert "BOM" in message or "byte order mark" in message.lower(), message


def check_c40b(server: Server) -> None:
    case = BY_ID["C40b"]
    req = case_request("C40b", server)
    t0 = req | {"temperature": 0}
    data, data_t0 = json.dumps(req).encode(), json.dumps(t0).encode()
    r = run_all(server, {
        "gzip": ("raw", gzip.compress(data), case["headers"]),
        "gzip_t0": ("raw", gzip.compress(data_t0), case["headers"]),
        "plain_t0": t0,
        "identity": ("raw", data, {"Content-Type": "application/json", "Content-Encoding": "identity"}),
    })
    assert content(r["identity"]) is not None
    res = r["gzip"]
    if res["status"] == 200:
        assert content(res) is not None
        assert content(r["gzip_t0"]) == content(r["plain_t0"])
    else:
        assert res["status"] in (400, 415), res
        message = res["json"]["error"]["message"]
        assert "encoding" in message.lower() and "utf-8" not in message.lower(), message


TEMPLATE_RAISING = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""Gemma/Mistral-style: no system role, strict user/assistant alternation (as the C37 note asks)."""

def start_raising_server(tmp: Path) -> Server:
    """A second server on the default model's GGUF (linked under another name) whose cached config and
    tokenizer (a copy of the default model's, issue 46: no weights there) carry a template that raises.

    Call after the default server has started (its start writes the default model's folder once)."""
    from proxy.models import DEFAULT_MODEL_NAME, cache_root, default_gguf_path
    from proxy.settings import Settings

    src = cache_root(Settings()) / DEFAULT_MODEL_NAME  # written by the default server's start
    folder = tmp / "cache" / "SmolLM2-raising-template"
    folder.mkdir(parents=True)
    for f in src.iterdir():
        if f.name == "chat_template.jinja":
            (folder / f.name).write_text(TEMPLATE_RAISING)
        elif f.suffix != ".safetensors":  # an older version's converted weights are not read
            os.symlink(f, folder / f.name)
    gguf = tmp / "SmolLM2-raising-template.gguf"
    os.symlink(default_gguf_path(), gguf)
    srv = start_serve(["--model", str(gguf), "--cache-dir", str(tmp / "cache"), "--enforce-eager",
                       "--num-threads", "1", "--max-num-seqs", "4",
                       "--kv-cache-bytes", str(32 << 20), "--no-engine-process"], tmp / "server.log",
                      timeout_s=300)
    atexit.register(srv.stop, 15.0)
    card = httpx.get(f"{srv.base_url}/v1/models", timeout=10).json()["data"][0]
    return Server(srv.base_url, srv.port, card["id"], card["max_model_len"], srv.process, srv.log_path)


@pytest.fixture(scope="module")
def raising(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_raising_server(tmp_path_factory.mktemp("raising_template"))
    yield srv
    stop(srv.process, 15.0)


def check_c37(cid: str, srv: Server) -> None:
    req = case_request(cid, srv)
    valid = {"model": srv.model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 2,
             "temperature": 0}
    variants = {"given": req, "other": plain_of(req) if req.get("stream") else stream_of(req)}
    r = run_all(srv, variants)
    reason = "System role not supported" if cid == "C37a" else "Conversation roles must alternate"
    for key, res in r.items():
        assert res["status"] == 400 and res["elapsed"] < 1.0, (key, res["status"], res["elapsed"])
        assert res["headers"]["content-type"] == "application/json", key
        err = res["json"]["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == "messages", err
        assert reason in err["message"], err
        assert "Traceback" not in err["message"] and "{%" not in err["message"], err
    h = srv.health()
    assert h["num_running"] == 0 and h["num_waiting"] == 0
    after = run_all(srv, {"valid": valid})["valid"]
    assert ok(after)["usage"]["completion_tokens"] >= 1


CHECKS = {
    "C29a": check_c29a, "C29b": check_c29b, "C30": check_c30, "C31a": check_c31a, "C31b": check_c31b,
    "C32a": check_c32a,
    "C32b": lambda s: check_no_stop("C32b", s),
    "C32c": lambda s: check_no_stop("C32c", s),
    "C33": check_c33, "C34a": check_c34a, "C34b": check_c34b, "C34c": check_c34c,
    "C40a": check_c40a, "C40b": check_c40b,
}


def test_every_case_has_a_check() -> None:
    assert sorted([*CHECKS, "C37a", "C37b"]) == sorted(c["id"] for c in CASES)


@pytest.mark.parametrize("cid", [c["id"] for c in CASES])
def test_request_compat_case(cid: str, server: Server, request: pytest.FixtureRequest) -> None:
    if cid in ("C37a", "C37b"):  # the second server starts only for these two
        check_c37(cid, request.getfixturevalue("raising"))
    else:
        CHECKS[cid](server)
    assert server.health()["status"] == "ready"
