"""Tools and response_format over the in-process app with a scripted engine: response shapes, 400s."""

from __future__ import annotations

import json

from .conftest import chat_body, reply_ids, run, serve, sse_json
from .fakes import FakeEngine, make_tokenizer

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HERMES = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def _serve_reply(text: str, **kw):
    return serve(FakeEngine(reply_ids=reply_ids(make_tokenizer(), text)), **kw)


def test_auto_tool_call_non_stream_and_stream() -> None:
    async def main():
        async with _serve_reply(HERMES, tool_call_parser="hermes", max_model_len=2048) as s:
            body = chat_body(tools=[TOOL], n=2)
            full = await s.client.post("/v1/chat/completions", json=body)
            streamed = await s.client.post("/v1/chat/completions", json={**body, "stream": True})
            return full, streamed, s.engine

    full, streamed, engine = run(main())
    assert full.status_code == 200, full.text
    for choice in full.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls"
        msg = choice["message"]
        assert msg["content"] == "Sure." and len(msg["tool_calls"]) == 1
        call = msg["tool_calls"][0]
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert all(p.structured_outputs is None for _, _, p in engine.submitted)
    chunks = sse_json(streamed.content)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert "".join(c["delta"].get("content") or "" for c in mine) == "Sure."
        calls = [d for c in mine for d in c["delta"].get("tool_calls") or []]
        assert calls[0]["function"] == {"name": "get_weather", "arguments": ""} and calls[0]["id"].startswith(
            "call_"
        )
        assert "".join(d["function"]["arguments"] for d in calls) == '{"city": "Oslo"}'
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["tool_calls"]


def test_required_and_named_use_a_grammar() -> None:
    async def main():
        async with _serve_reply(
            '[{"name": "get_weather", "parameters": {"city": "Rome"}}]', with_grammar=True, max_model_len=2048
        ) as s:
            r1 = await s.client.post(
                "/v1/chat/completions", json=chat_body(tools=[TOOL], tool_choice="required")
            )
            r2 = await s.client.post("/v1/chat/completions", json=chat_body(
                tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
            r3 = await s.client.post("/v1/chat/completions", json=chat_body(
                response_format={"type": "json_object"}))
            metrics = (await s.client.get("/metrics")).text
            return r1, r2, r3, s.engine, metrics

    r1, r2, r3, engine, metrics = run(main())
    choice = r1.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}
    kinds = [p.structured_outputs.kind for _, _, p in engine.submitted]
    assert kinds == ["json", "json", "json_object"]
    required_schema = json.loads(engine.submitted[0][2].structured_outputs.spec)
    assert required_schema["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
    assert json.loads(engine.submitted[1][2].structured_outputs.spec) == TOOL["function"]["parameters"]
    # The scripted reply (an array) is not the named function's arguments object: it stays content.
    named = r2.json()["choices"][0]
    assert named["finish_reason"] == "stop" and named["message"] == {
        "role": "assistant", "content": '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'}
    assert r3.status_code == 200
    # The default template has no tools: the tool list went into a system message.
    prompt = make_tokenizer().decode(engine.submitted[0][1])
    assert "get_weather" in prompt and "JSON array of calls" in prompt
    assert 'kind="tool_required"' in metrics and 'kind="json_object"' in metrics


def test_structured_400s() -> None:
    async def main():
        async with _serve_reply("x", with_grammar=True, max_model_len=2048) as s:
            out = []
            for body in (
                chat_body(guided_regex="(unclosed"),
                chat_body(
                    response_format={"type": "json_schema", "json_schema": {"schema": {"oneOf": [{}]}}}
                ),
                chat_body(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"}),
            ):
                r = await s.client.post("/v1/chat/completions", json=body)
                out.append((r.status_code, r.json()["error"]["param"], r.json()["error"]["message"]))
            return out

    (s1, p1, m1), (s2, p2, m2), (s3, p3, _) = run(main())
    assert (s1, p1) == (400, "guided_regex") and "cannot be compiled" in m1
    assert (s2, p2) == (400, "response_format.json_schema.schema") and "'oneOf'" in m2
    assert (s3, p3) == (400, "response_format")


def test_agent_loop_history_renders() -> None:
    async def main():
        async with _serve_reply("It is sunny.") as s:
            r = await s.client.post("/v1/chat/completions", json={"model": "test-model", "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
            return r, s.engine

    r, engine = run(main())
    assert r.status_code == 200, r.text
    prompt = make_tokenizer().decode(engine.submitted[0][1])
    assert '"get_weather"' in prompt and "sunny" in prompt


def test_completions_refuse_constraints_rather_than_ignore_them() -> None:
    async def main():
        async with _serve_reply("x") as s:
            r = await s.client.post("/v1/completions", json={"model": "test-model", "prompt": "Hi",
                                                             "guided_regex": "[0-9]+"})
            return r

    r = run(main())
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"


def _tool_deltas(chunks: list[dict]) -> list[dict]:
    return [d for c in chunks if c["choices"] for d in c["choices"][0]["delta"].get("tool_calls") or []]


def _check_streamed_call(chunks: list[dict], name: str, arguments: str) -> None:
    """OpenAI's shape: a header (index, id, type, name; arguments ""), then only arguments fragments,
    one call entry per chunk, growing as the tokens came (more than one), joining to ``arguments``."""
    deltas = _tool_deltas(chunks)
    assert all(len(c["choices"][0]["delta"].get("tool_calls") or []) <= 1 for c in chunks if c["choices"])
    head, *rest = deltas
    assert head["index"] == 0 and head["id"].startswith("call_") and head["type"] == "function"
    assert head["function"] == {"name": name, "arguments": ""}
    assert all(d == {"index": 0, "function": {"arguments": d["function"]["arguments"]}} for d in rest)
    fragments = [d["function"]["arguments"] for d in rest]
    assert len(fragments) > 1 and all(fragments)
    assert "".join(fragments) == arguments


def test_auto_on_a_template_without_tools_is_taught_hermes() -> None:
    """The default model's case (C26): no tool support in the template, tool_choice "auto" is served:
    the tools and the <tool_call> format go into a system message, the answer through the hermes parser."""
    reply = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'

    async def main():
        engine = FakeEngine(reply_ids=reply_ids(make_tokenizer(), reply), step_s=0.002)
        async with serve(engine, max_model_len=2048) as s:
            body = chat_body("Weather in Oslo?", tools=[TOOL], tool_choice="auto", temperature=0)
            full = await s.client.post("/v1/chat/completions", json=body)
            streamed = await s.client.post("/v1/chat/completions", json={**body, "stream": True})
            history = await s.client.post("/v1/chat/completions", json={**body, "messages": [
                *body["messages"],
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
            return full, streamed, history, s.engine

    full, streamed, history, engine = run(main())
    assert full.status_code == streamed.status_code == history.status_code == 200, full.text
    prompt = make_tokenizer().decode(engine.submitted[0][1])
    assert prompt.startswith("system\nYou have access to the following functions:\n")
    assert '{"name": "get_weather", "parameters": {"type": "object"' in prompt
    assert '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call>' in prompt
    assert all(p.structured_outputs is None for _, _, p in engine.submitted)  # "auto": no grammar
    # an earlier call is shown to the model in the format it was taught
    earlier = make_tokenizer().decode(engine.submitted[2][1])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in earlier
    choice = full.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    chunks = sse_json(streamed.content)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert (
        "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        == "Let me look."
    )
    _check_streamed_call(chunks, "get_weather", call["function"]["arguments"])
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == [
        "tool_calls"
    ]


def test_grammar_tool_calls_stream_their_arguments() -> None:
    """required and named: the arguments stream as the grammar-constrained tokens come."""
    required_reply = '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'

    async def main():
        out = []
        for reply, choice in (
            (required_reply, "required"),
            ('{"city": "Bern"}', {"type": "function", "function": {"name": "get_weather"}}),
        ):
            engine = FakeEngine(reply_ids=reply_ids(make_tokenizer(), reply), step_s=0.002)
            async with serve(engine, with_grammar=True, max_model_len=2048) as s:
                body = chat_body(tools=[TOOL], tool_choice=choice)
                full = await s.client.post("/v1/chat/completions", json=body)
                streamed = await s.client.post("/v1/chat/completions", json={**body, "stream": True})
                out.append((full.json(), sse_json(streamed.content)))
        return out

    (req_full, req_chunks), (named_full, named_chunks) = run(main())
    for full, chunks, args in (
        (req_full, req_chunks, '{"city": "Rome"}'),
        (named_full, named_chunks, '{"city": "Bern"}'),
    ):
        choice = full["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": args}
        _check_streamed_call(chunks, "get_weather", args)
        assert not any(c["choices"][0]["delta"].get("content") for c in chunks if c["choices"])


MISTRAL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _mistral_hf_tokenizer():
    """The test tokenizer with Mistral's markers as special tokens and a template that uses them."""
    import copy

    from .fakes import make_hf_tokenizer

    hf = copy.deepcopy(make_hf_tokenizer())
    hf.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    hf.chat_template = MISTRAL_TEMPLATE
    return hf


def test_detokenizer_keeps_only_the_asked_special_tokens() -> None:
    from proxy.tokenizer import RedecodeDetokenizer, Tokenizer

    tok = Tokenizer(_mistral_hf_tokenizer())
    marker, args = (tok.hf_tokenizer.convert_tokens_to_ids(t) for t in ("[TOOL_CALLS]", "[ARGS]"))
    (eos,) = tok.special_ids_of(["<|im_end|>"])
    assert tok.special_ids_of(["[TOOL_CALLS]", "[ARGS]", "<tool_call>", "hello"]) == {marker, args}
    ids = [
        marker,
        *tok.encode("f", add_special_tokens=False),
        args,
        *tok.encode('{"a": 1}', add_special_tokens=False),
        eos,
    ]
    assert tok.decode(ids) == 'f{"a": 1}'  # skip_special_tokens=True drops the markers
    for table_path in (True, False):
        if not table_path:
            tok.decode_table = None  # the exact fallback detokenizer
        plain = tok.new_detokenizer()
        keeping = tok.new_detokenizer(frozenset({marker, args}))
        assert isinstance(keeping, RedecodeDetokenizer) is not table_path
        assert "".join(plain.feed([i]) for i in ids) + plain.flush() == 'f{"a": 1}'
        # EOS stays dropped: only the asked markers come back
        assert "".join(keeping.feed([i]) for i in ids) + keeping.flush() == '[TOOL_CALLS]f[ARGS]{"a": 1}'


def test_mistral_marker_special_token_reaches_the_parser(monkeypatch) -> None:
    """[TOOL_CALLS] is a special token in Mistral vocabularies: the detokenizer keeps it for the
    mistral parser (and for nothing else), so the call is parsed, stream and non-stream."""
    from proxy.tokenizer import Tokenizer

    from . import fakes

    hf = _mistral_hf_tokenizer()
    monkeypatch.setattr(fakes, "make_tokenizer", lambda: Tokenizer(hf))
    marker = hf.convert_tokens_to_ids("[TOOL_CALLS]")
    reply = list(hf.encode('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
                           add_special_tokens=False)) + [hf.convert_tokens_to_ids("<|im_end|>")]
    assert reply[0] == marker

    async def main():
        async with serve(FakeEngine(reply_ids=reply, step_s=0.002), max_model_len=2048) as s:
            body = chat_body(tools=[TOOL])
            full = await s.client.post("/v1/chat/completions", json=body)
            streamed = await s.client.post("/v1/chat/completions", json={**body, "stream": True})
            plain = await s.client.post("/v1/chat/completions", json=chat_body())  # no tools: markers dropped
            return full, streamed, plain, s.engine

    full, streamed, plain, engine = run(main())
    markers = frozenset({marker, hf.convert_tokens_to_ids("[ARGS]")})
    assert [p.keep_special_ids for _, _, p in engine.submitted] == [markers, markers, frozenset()]
    choice = full.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    assert choice["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Oslo"}',
    }
    _check_streamed_call(sse_json(streamed.content), "get_weather", '{"city": "Oslo"}')
    assert (
        plain.json()["choices"][0]["message"]["content"]
        == '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    )


THINK_THEN_CALL = ('<think>Maybe <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
                   '</tool_call> no: Oslo.</think>' + HERMES)


def test_a_call_inside_the_thinking_stays_reasoning_and_the_call_after_it_is_parsed() -> None:
    async def main():
        async with _serve_reply(THINK_THEN_CALL, tool_call_parser="hermes", reasoning_parser="qwen3",
                                max_model_len=2048) as s:
            body = chat_body(tools=[TOOL])
            full = await s.client.post("/v1/chat/completions", json=body)
            streamed = await s.client.post("/v1/chat/completions", json={**body, "stream": True})
            return full.json(), sse_json(streamed.content)

    full, chunks = run(main())
    msg = full["choices"][0]["message"]
    thinking = 'Maybe <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call> no: Oslo.'
    assert msg["reasoning_content"] == msg["reasoning"] == thinking
    assert msg["content"] == "Sure." and full["choices"][0]["finish_reason"] == "tool_calls"
    oslo = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert [c["function"] for c in msg["tool_calls"]] == [oslo]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == thinking
    assert "".join(d.get("content") or "" for d in deltas) == "Sure."
    calls = [t for d in deltas for t in d.get("tool_calls") or []]
    assert "".join(t["function"]["arguments"] for t in calls) == '{"city": "Oslo"}'


HARMONY = ("<|channel|>analysis<|message|>The user wants the weather.<|end|>"
           "<|start|>assistant<|channel|>final<|message|>It is sunny in Oslo.")


def test_harmony_channels_split_and_the_openai_sdk_reads_the_fields() -> None:
    """GPT-OSS's harmony output (analysis then final channel) through the real app: the OpenAI SDK's
    message and stream deltas carry the thinking as ``reasoning_content`` beside ``content``."""
    from openai import AsyncOpenAI

    async def main():
        async with _serve_reply(HARMONY, reasoning_parser="gpt_oss", max_model_len=2048) as s:
            sdk = AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=s.client)
            msg = (await sdk.chat.completions.create(
                model="test-model", messages=[{"role": "user", "content": "weather?"}])).choices[0].message
            stream = await sdk.chat.completions.create(
                model="test-model", messages=[{"role": "user", "content": "weather?"}], stream=True,
                stream_options={"include_usage": True})
            chunks = [c async for c in stream]
            return msg, chunks

    msg, chunks = run(main())
    assert msg.content == "It is sunny in Oslo."
    thinking = "The user wants the weather."
    assert msg.model_extra["reasoning_content"] == msg.model_extra["reasoning"] == thinking
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == msg.content
    assert "".join((d.model_extra or {}).get("reasoning_content", "") for d in deltas) == thinking
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens > 0
