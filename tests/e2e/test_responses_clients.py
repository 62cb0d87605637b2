"""The Responses API (``/v1/responses``) with the clients built on it, the default model: the OpenAI
Agents SDK's default model class (``OpenAIResponsesModel``) running a function tool, and LangChain's
``ChatOpenAI(use_responses_api=True)`` (invoke, stream, structured output, a forced tool call).

One server for the module (the engine-thread one, shared through ``get_server``); no request leaves
127.0.0.1 (the Agents SDK's tracing is disabled)."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel, Field

from .server import Server, get_server

pytestmark = pytest.mark.slow


class City(BaseModel):
    """A city and its country."""

    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


class GetWeather(BaseModel):
    """Get the current weather of a city."""

    city: str = Field(max_length=20)


ANSWER = "It is sunny in Paris."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Server:
    return get_server(tmp_path_factory.mktemp("responses-clients"))


def test_agents_sdk_runs_a_function_tool(server: Server) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather of a city."""
        calls.append(city)
        return f"Sunny, 21 C in {city}."

    async def main() -> tuple[object, object]:
        client = AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        model = OpenAIResponsesModel(model=server.model, openai_client=client)
        agent = Agent(
            name="weather",
            instructions="Answer with the weather tool.",
            tools=[get_weather],
            model=model,
            model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
            tool_use_behavior="stop_on_first_tool",
        )
        try:
            first = await Runner.run(agent, "What is the weather in Paris?", max_turns=2)
            # the whole conversation sent back as input items (the SDK's own item shapes), tools off; an
            # incomplete response is an error to the SDK, so guided_choice keeps the answer short and complete
            settings = ModelSettings(
                tool_choice="none", temperature=0, max_tokens=20, extra_body={"guided_choice": [ANSWER]}
            )
            answer = agent.clone(model_settings=settings)
            second = await Runner.run(answer, first.to_input_list(), max_turns=1)
            return first, second
        finally:
            await client.close()

    first, second = asyncio.run(main())
    assert len(calls) == 1 and calls[0]
    assert first.final_output == f"Sunny, 21 C in {calls[0]}."  # type: ignore[attr-defined]
    (response,) = first.raw_responses  # type: ignore[attr-defined]
    assert response.response_id.startswith("resp_") and response.usage.input_tokens > 0
    sent = [i.get("type") for i in first.to_input_list()]  # type: ignore[attr-defined]
    assert sent == [None, "function_call", "function_call_output"]  # the user message has no type
    assert second.final_output == ANSWER  # type: ignore[attr-defined]
    assert len(calls) == 1


def _chat(server: Server, **kw: object) -> object:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=server.model,
        base_url=f"{server.base_url}/v1",
        api_key="unused",  # type: ignore[arg-type]
        use_responses_api=True,
        temperature=0,
        max_retries=0,
        **kw,
    )


def test_langchain_invoke_and_stream(server: Server) -> None:
    llm = _chat(server, max_tokens=8)
    msg = llm.invoke("Write a story about a dragon who learns to bake bread.")  # type: ignore[attr-defined]
    assert msg.text and msg.response_metadata["status"] == "incomplete"
    assert msg.usage_metadata["output_tokens"] == 8
    assert msg.response_metadata["id"].startswith("resp_")
    assert msg.response_metadata["incomplete_details"] == {"reason": "max_output_tokens"}
    chunks = list(llm.stream("Write a story about a dragon who learns to bake bread."))  # type: ignore[attr-defined]
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert total.text == msg.text
    assert sum(1 for c in chunks if c.text) >= 2
    assert total.usage_metadata["output_tokens"] == 8


def test_langchain_structured_output_and_tools(server: Server) -> None:
    llm = _chat(server, max_tokens=60)
    city = llm.with_structured_output(City).invoke("Describe the capital of France.")  # type: ignore[attr-defined]
    assert isinstance(city, City) and city.name
    tools = llm.bind_tools([GetWeather], tool_choice="any", parallel_tool_calls=False)  # type: ignore[attr-defined]
    msg = tools.invoke("What is the weather in Paris?")
    (call,) = msg.tool_calls
    assert call["name"] == "GetWeather" and list(call["args"]) == ["city"] and call["args"]["city"]
    assert call["id"].startswith("call_") and msg.response_metadata["status"] == "completed"
    streamed = None
    for chunk in tools.stream("What is the weather in Paris?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None and [c["args"] for c in streamed.tool_calls] == [call["args"]]
