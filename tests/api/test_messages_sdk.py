"""The Anthropic Python SDK and LangChain's ``ChatAnthropic``, with their defaults, against a real
uvicorn on 127.0.0.1 over the scripted engine: ``messages.create``, the ``.messages.stream()`` helper
(its final message equals the non-stream one), a ``tool_use`` -> ``tool_result`` round trip,
``messages.count_tokens``, the SDK's typed errors, and ``ChatAnthropic`` invoke / stream / tools."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from .conftest import REPLY, reply_ids
from .fakes import FakeEngine, make_tokenizer, thread_server
from .messages_sse import MODEL, THINK_CALL, TOOL, same_message

KEY = "sk-test"


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, FakeEngine]]:
    engine = FakeEngine(reply_ids=reply_ids(make_tokenizer()))
    with thread_server(engine, api_keys=(KEY,), tool_call_parser="hermes", reasoning_parser="qwen3",
                       keepalive_interval_s=0.05) as (port, _):
        yield f"http://127.0.0.1:{port}", engine


@pytest.fixture
def client(served: tuple[str, FakeEngine]) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=served[0], api_key=KEY, max_retries=0, timeout=30) as c:
        yield c


def _reply(engine: FakeEngine, text: str) -> None:
    engine.reply_ids = reply_ids(make_tokenizer(), text)


ASK: dict[str, Any] = {"model": MODEL, "max_tokens": 500,
                       "messages": [{"role": "user", "content": "Weather in Oslo?"}]}


def test_create_stream_helper_and_count_tokens(client: anthropic.Anthropic,
                                               served: tuple[str, FakeEngine]) -> None:
    _reply(served[1], REPLY)
    msg = client.messages.create(**ASK, system="Be brief.")
    assert isinstance(msg, anthropic.types.Message) and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == REPLY
    assert msg.stop_reason == "end_turn" and msg.usage.output_tokens > 0
    with client.messages.stream(**ASK, system="Be brief.") as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == REPLY and same_message(final.model_dump(), msg.model_dump())
    count = client.messages.count_tokens(model=MODEL, messages=ASK["messages"], system="Be brief.")
    assert count.input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)


def test_tool_use_round_trip_with_thinking_sent_back(client: anthropic.Anthropic,
                                                     served: tuple[str, FakeEngine]) -> None:
    engine = served[1]
    _reply(engine, THINK_CALL)
    ask = {**ASK, "tools": [TOOL], "thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2000}
    msg = client.messages.create(**ask)
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.stop_reason == "tool_use"
    call = msg.content[2]
    assert isinstance(call, anthropic.types.ToolUseBlock) and call.input == {"city": "Oslo"}
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert same_message(final.model_dump(), msg.model_dump())
    _reply(engine, "It is sunny in Oslo.")
    follow = [*ask["messages"], {"role": "assistant", "content": msg.content},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                            "content": "Sunny, 21 C"}]}]
    answer = client.messages.create(**{**ask, "messages": follow})
    assert answer.content[0].type == "text" and answer.content[0].text == "It is sunny in Oslo."
    prompt = make_tokenizer().decode(engine.submitted[-1][1])
    assert "Sunny, 21 C" in prompt and '"city": "Oslo"' in prompt


def test_sdk_errors_are_typed(client: anthropic.Anthropic, served: tuple[str, FakeEngine]) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(**{**ASK, "messages": [{"role": "user", "content": [image]}]})
    assert bad.value.status_code == 400 and "'messages[0].content[0]' is an image" in bad.value.message
    assert "reads text only" in bad.value.message
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    server_tool = {**ASK, "tools": [{"type": "web_search_20250305", "name": "w"}]}
    with pytest.raises(anthropic.BadRequestError), client.messages.stream(**server_tool) as s:
        s.get_final_message()
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(**{**ASK, "model": "claude-opus-4-1"})
    other = anthropic.Anthropic(base_url=served[0], api_key="wrong", max_retries=0)
    with other, pytest.raises(anthropic.AuthenticationError):
        other.messages.count_tokens(model=MODEL, messages=ASK["messages"])


def test_langchain_chat_anthropic(served: tuple[str, FakeEngine]) -> None:
    from langchain_anthropic import ChatAnthropic

    base, engine = served
    llm = ChatAnthropic(model=MODEL, anthropic_api_url=base, api_key=KEY, max_tokens=300, max_retries=0)
    _reply(engine, REPLY)
    assert llm.invoke("Hi").content == REPLY
    assert "".join(str(c.content) for c in llm.stream("Hi")) == REPLY
    _reply(engine, THINK_CALL)
    calls = llm.bind_tools([TOOL]).invoke("Weather in Oslo?").tool_calls
    assert [(c["name"], c["args"]) for c in calls] == [("get_weather", {"city": "Oslo"})]
