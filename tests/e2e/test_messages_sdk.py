"""The Anthropic Messages API end to end with the ``anthropic`` Python SDK and the default model.

One server for the module (the engine-thread one of the e2e suite, shared through ``get_server``).
Exact values where the model is deterministic (temperature 0): the stream helper's final message
equals the non-stream message (text, and a forced tool call's input), ``count_tokens`` equals the
message's input tokens, ``max_tokens`` 32000 is lowered to the context, a prompt over the context is
Anthropic's "prompt is too long" 400; the second identical request reads its prompt from the cache."""

from __future__ import annotations

import anthropic
import pytest

from .server import Server, get_server

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Write a story about a dragon who learns to bake bread."}]
WEATHER = {"name": "get_weather", "description": "Get the current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Server:
    return get_server(tmp_path_factory.mktemp("messages"))


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


def _strip(message: anthropic.types.Message) -> dict:
    body = message.model_dump(exclude={"id", "usage"})
    body["content"] = [{k: v for k, v in b.items() if k != "id"} for b in body["content"]]
    return body


def test_text_stream_equals_create_and_count_tokens(client: anthropic.Anthropic, server: Server) -> None:
    kw = {"model": server.model, "max_tokens": 24, "system": "You are a storyteller.", "messages": ASK,
          "extra_body": {"temperature": 0}}  # recent SDKs have no sampling arguments; the wire has them
    msg = client.messages.create(**kw)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 24
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == msg.content[0].text and _strip(final) == _strip(msg)
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again: whole blocks from the cache
    total = final.usage.input_tokens + final.usage.cache_read_input_tokens
    count = client.messages.count_tokens(model=server.model, system="You are a storyteller.", messages=ASK)
    assert count.input_tokens == total == msg.usage.input_tokens + msg.usage.cache_read_input_tokens


def test_forced_tool_input_streams_as_created(client: anthropic.Anthropic, server: Server) -> None:
    kw = {"model": server.model, "max_tokens": 64, "extra_body": {"temperature": 0}, "tools": [WEATHER],
          "tool_choice": {"type": "tool", "name": "get_weather"},
          "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}
    msg = client.messages.create(**kw)
    assert msg.stop_reason == "tool_use" and msg.content[-1].type == "tool_use"
    assert isinstance(msg.content[-1].input.get("city"), str)
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert _strip(final) == _strip(msg)


def test_context_rules(client: anthropic.Anthropic, server: Server) -> None:
    msg = client.messages.create(model=server.model, max_tokens=32000, messages=ASK, stop_sequences=["bread"],
                                 extra_body={"temperature": 0})
    assert msg.stop_reason in ("end_turn", "stop_sequence", "max_tokens")
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=server.model, max_tokens=10,
                               messages=[{"role": "user", "content": "word " * server.max_model_len}])
    assert err.value.body["error"]["message"].startswith("prompt is too long: ")
    assert f"> {server.max_model_len - 1} maximum" in err.value.message
