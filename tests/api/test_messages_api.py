"""The Anthropic Messages API (``/v1/messages``) over the in-process app and a scripted engine: the
message and its stream (validated with the SDK's types, stream == non-stream), stop reasons, the
context rules, ``count_tokens``, the translation into the chat request it means."""

from __future__ import annotations

import json
from typing import Any

from anthropic.types import Message

from .conftest import MAX_MODEL_LEN, REPLY, chat_body, reply_ids, run, serve
from .fakes import FakeEngine, make_tokenizer
from .messages_sse import HERMES, THINK_CALL, TOOL, body, events, fold, same_message


def _engine(text: str = REPLY) -> FakeEngine:
    return FakeEngine(reply_ids=reply_ids(make_tokenizer(), text))


async def _both(s: Any, b: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(non-stream message, the message its stream folds into); both 200."""
    full = await s.client.post("/v1/messages", json=b)
    streamed = await s.client.post("/v1/messages", json={**b, "stream": True})
    assert full.status_code == 200, full.text
    assert streamed.status_code == 200, streamed.text
    assert streamed.headers["content-type"].startswith("text/event-stream")
    Message.model_validate(full.json())
    return full.json(), fold(events(streamed.content))


def test_text_message_and_its_stream_agree() -> None:
    async def main():
        async with serve(_engine()) as s:
            msg, folded = await _both(s, body())
            count = await s.client.post("/v1/messages/count_tokens", json=body())
            return msg, folded, count.json()

    msg, folded, count = run(main())
    assert msg["id"].startswith("msg_") and msg["type"] == "message" and msg["role"] == "assistant"
    assert msg["content"] == [{"type": "text", "text": REPLY}] and msg["model"] == "test-model"
    assert msg["stop_reason"] == "end_turn" and msg["stop_sequence"] is None
    usage = msg["usage"]
    assert usage["output_tokens"] == len(reply_ids(make_tokenizer()))
    assert count == {"input_tokens": usage["input_tokens"] + usage["cache_read_input_tokens"]}
    assert same_message(msg, folded)


def test_thinking_text_and_tool_use_blocks_stream_as_they_are_whole() -> None:
    async def main():
        async with serve(_engine(THINK_CALL), tool_call_parser="hermes", reasoning_parser="qwen3",
                         max_model_len=2048) as s:
            return await _both(s, body("Weather in Oslo?", tools=[TOOL]))

    msg, folded = run(main())
    assert [b["type"] for b in msg["content"]] == ["thinking", "text", "tool_use"]
    thinking, text, call = msg["content"]
    assert thinking["thinking"] == "Hmm, 你好 🤗 weather." and thinking["signature"]
    assert text["text"] == "Sure."
    assert call["id"].startswith("toolu_") and call["name"] == "get_weather"
    assert call["input"] == {"city": "Oslo"}
    assert msg["stop_reason"] == "tool_use"
    assert same_message(msg, folded)
    assert folded["content"][0]["signature"] == thinking["signature"]


def test_stop_sequence_and_max_tokens_stop_reasons() -> None:
    async def main():
        async with serve(_engine()) as s:
            stopped = await _both(s, body(stop_sequences=["zzz", "END"]))
            cut = await _both(s, body(max_tokens=3))
            return stopped, cut

    (stopped, folded_stop), (cut, folded_cut) = run(main())
    assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == "END"
    assert stopped["content"][0]["text"] == REPLY.split("END")[0]
    assert same_message(stopped, folded_stop)
    assert cut["stop_reason"] == "max_tokens" and cut["usage"]["output_tokens"] == 3
    assert same_message(cut, folded_cut)


def test_max_tokens_is_lowered_to_the_context_and_a_long_prompt_is_refused_as_anthropic_words_it() -> None:
    async def main():
        async with serve(_engine()) as s:
            ok = await s.client.post("/v1/messages", json=body(max_tokens=32000))
            long = await s.client.post("/v1/messages", json=body("alpha beta " * 200))
            return ok, long, s.engine.submitted

    ok, long, submitted = run(main())
    assert ok.status_code == 200, ok.text
    prompt, params = submitted[0][1], submitted[0][2]
    assert params.max_tokens == MAX_MODEL_LEN - len(prompt)
    assert long.status_code == 400
    err = long.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    n = int(err["error"]["message"].split()[4])
    assert err["error"]["message"] == f"prompt is too long: {n} tokens > {MAX_MODEL_LEN - 1} maximum"
    assert n > MAX_MODEL_LEN


CONVERSATION = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Use the tool.", "signature": "c2ln"},
        {"type": "redacted_thinking", "data": "b3BhcXVl"},
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny"}]},
        {"type": "text", "text": "And tomorrow?"}]},
    {"role": "system", "content": "Answer briefly."},
]
CHAT_EQUIVALENT = [
    {"role": "system", "content": "Be kind.\nBe brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "Let me check.", "reasoning_content": "Use the tool.", "tool_calls": [
        {"id": "toolu_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
    {"role": "user", "content": "And tomorrow?"},
    {"role": "system", "content": "Answer briefly."},
]


def test_a_conversation_renders_the_prompt_of_the_chat_request_it_means() -> None:
    system = [{"type": "text", "text": "Be kind.", "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "Be brief."}]
    tools = [TOOL, {**TOOL, "name": "other", "cache_control": {"type": "ephemeral"}}]
    chat_tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                    "parameters": t["input_schema"]}} for t in tools]

    async def main():
        async with serve(_engine(HERMES), tool_call_parser="hermes", max_model_len=2048) as s:
            m = await s.client.post("/v1/messages", json={
                **body(), "messages": CONVERSATION, "system": system, "tools": tools, "stop_sequences": ["X"],
                "temperature": 0.5, "top_p": 0.9, "top_k": 7, "metadata": {"user_id": "u1"},
                "context_management": {"edits": []}, "anthropic_beta_unknown_field": 1})
            c = await s.client.post("/v1/chat/completions", json=chat_body(
                messages=CHAT_EQUIVALENT, tools=chat_tools, max_tokens=1000, stop=["X"], temperature=0.5,
                top_p=0.9, top_k=7))
            return m, c, s.engine.submitted

    m, c, submitted = run(main())
    assert m.status_code == 200 and c.status_code == 200, (m.text, c.text)
    (_, ids_m, p_m), (_, ids_c, p_c) = submitted
    assert ids_m == ids_c
    assert (p_m.temperature, p_m.top_p, p_m.top_k, p_m.stop) == (0.5, 0.9, 7, ("X",)) == (
        p_c.temperature, p_c.top_p, p_c.top_k, p_c.stop)
    prompt = make_tokenizer().decode(ids_m)
    assert "Sunny" in prompt and "Be kind.\nBe brief." in prompt


def test_tool_result_is_error_and_string_content() -> None:
    async def main():
        async with serve(_engine(), max_model_len=2048) as s:
            msgs = [CONVERSATION[0], CONVERSATION[1], {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "boom", "is_error": True}]}]
            r = await s.client.post("/v1/messages", json={**body(), "messages": msgs})
            return r, s.engine.submitted

    r, submitted = run(main())
    assert r.status_code == 200, r.text
    assert "Error: boom" in make_tokenizer().decode(submitted[0][1])


def test_tool_choice_any_and_tool_are_grammar_enforced() -> None:
    async def main():
        async with serve(_engine('{"city": "Oslo"}'), with_grammar=True, max_model_len=2048) as s:
            named = await s.client.post("/v1/messages", json=body(
                tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather"}))
            call = '[{"name": "get_weather", "parameters": {"city": "A"}}]'
            s.engine.reply_ids = reply_ids(make_tokenizer(), call)
            anyone = await _both(s, body(tools=[TOOL], tool_choice={"type": "any",
                                                                    "disable_parallel_tool_use": True}))
            return named.json(), anyone, s.engine.submitted

    named, (anyone, folded), submitted = run(main())
    assert named["content"][0]["input"] == {"city": "Oslo"} and named["stop_reason"] == "tool_use"
    assert anyone["content"][0]["input"] == {"city": "A"} and same_message(anyone, folded)
    assert all(p.structured_outputs is not None for _, _, p in submitted)
    assert '"maxItems": 1' in submitted[1][2].structured_outputs.spec


def test_thinking_switch_reaches_the_template() -> None:
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}NOTHINK{% endif %}")

    async def main():
        async with serve(_engine()) as s:
            s.app.state.server.client.tokenizer.hf_tokenizer.chat_template = template
            try:
                off = await s.client.post("/v1/messages/count_tokens", json={
                    "model": "test-model", "messages": [{"role": "user", "content": "Hi"}],
                    "thinking": {"type": "disabled"}})
                on = await s.client.post("/v1/messages/count_tokens", json={
                    "model": "test-model", "messages": [{"role": "user", "content": "Hi"}],
                    "thinking": {"type": "adaptive"}})
            finally:
                from .fakes import CHATML
                s.app.state.server.client.tokenizer.hf_tokenizer.chat_template = CHATML
            return off.json(), on.json()

    off, on = run(main())
    assert off["input_tokens"] > on["input_tokens"]


def test_metrics_count_messages_requests() -> None:
    async def main():
        async with serve(_engine()) as s:
            await s.client.post("/v1/messages", json=body())
            await s.client.post("/v1/messages/count_tokens", json=body())
            return (await s.client.get("/metrics")).text

    text = run(main())
    line = 'streamproxy:api_requests_total{endpoint="/v1/messages",model_name="test-model"} 1.0'
    assert line in text
    assert any(x.startswith("streamproxy:prompt_tokens_total") and not x.endswith(" 0.0")
               for x in text.splitlines())


def test_stream_events_carry_usage_and_utf8_whole_characters() -> None:
    async def main():
        async with serve(_engine("你好🤗é" * 3)) as s:
            r = await s.client.post("/v1/messages", json=body(stream=True))
            return r.content

    evts = events(run(main()))
    texts = [e["delta"]["text"] for e in evts if e["type"] == "content_block_delta"]
    assert "".join(texts) == "你好🤗é" * 3 and all("\ufffd" not in t for t in texts)
    start, delta = evts[0], next(e for e in evts if e["type"] == "message_delta")
    assert start["message"]["usage"]["output_tokens"] == 0
    assert delta["usage"]["output_tokens"] > 0 and delta["usage"]["input_tokens"] > 0
    assert json.dumps(evts[1]) == '{"type": "ping"}'


def test_a_last_assistant_message_is_continued() -> None:
    async def main():
        async with serve(_engine()) as s:
            msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
            r = await s.client.post("/v1/messages", json={**body(), "messages": msgs})
            count = await s.client.post("/v1/messages/count_tokens", json={**body(), "messages": msgs})
            call = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
            cut = {"role": "assistant", "content": [call]}
            bad = await s.client.post("/v1/messages", json={**body(), "messages": [msgs[0], cut]})
            return r, count.json(), bad, s.engine.submitted

    r, count, bad, submitted = run(main())
    assert r.status_code == 200, r.text
    prompt = make_tokenizer().decode(submitted[0][1])
    assert prompt.endswith("The answer is") and count["input_tokens"] == len(submitted[0][1])
    assert bad.status_code == 400 and "messages[1]" in bad.json()["error"]["message"]


def test_thinking_display_omitted_keeps_the_signature_and_drops_the_text() -> None:
    async def main():
        async with serve(_engine(THINK_CALL), tool_call_parser="hermes", reasoning_parser="qwen3",
                         max_model_len=2048) as s:
            shown = await s.client.post("/v1/messages", json=body(tools=[TOOL]))
            omitted = await _both(s, body(tools=[TOOL], thinking={"type": "adaptive", "display": "omitted"}))
            return shown.json(), omitted

    shown, (msg, folded) = run(main())
    assert msg["content"][0] == {"type": "thinking", "thinking": "",
                                 "signature": shown["content"][0]["signature"]}
    assert [b["type"] for b in msg["content"]] == ["thinking", "text", "tool_use"]
    assert msg["content"][1] == shown["content"][1] == {"type": "text", "text": "Sure."}
    assert same_message(msg, folded)


def test_vllm_sampling_extras_reach_the_engine() -> None:
    """``seed``, ``ignore_eos`` and vLLM's other sampling extras act as on chat completions (they are
    not Anthropic fields); a bad one is a 400 naming it."""
    async def main():
        async with serve(FakeEngine(reply_ids=reply_ids(make_tokenizer(), REPLY))) as s:
            ok = await s.client.post("/v1/messages", json=body(seed=7, ignore_eos=True, min_tokens=2))
            bad = await s.client.post("/v1/messages", json=body(seed="x"))
            return ok, bad, s.engine.submitted

    ok, bad, submitted = run(main())
    assert ok.status_code == 200, ok.text
    params = submitted[0][2]
    assert (params.seed, params.ignore_eos, params.min_tokens) == (7, True, 2)
    assert bad.status_code == 400 and "'seed'" in bad.json()["error"]["message"]
