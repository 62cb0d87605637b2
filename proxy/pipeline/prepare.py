"""A validated chat or completion request -> what the engine runs and what the output path needs.

:func:`prepare_chat` is vLLM's ``OpenAIServingChat._preprocess_chat`` in our terms: the messages and
tools go through the chat template (or, on a template without tool support, a system prompt), the
prompt is tokenized (off the event loop when long), ``max_tokens`` is resolved against the context,
and a grammar (``response_format``, a ``required`` / named tool choice) is compiled before the
request is submitted, so a bad schema is a 400 before anything runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from proxy import protocol
from proxy.engine.client import EngineClient
from proxy.errors import InvalidRequestError, ModelNotFoundError
from proxy.media.fetch import load_images
from proxy.media.prompt import PromptImages
from proxy.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from proxy.reasoning import get_reasoning_format, get_reasoning_parser, starts_in_reasoning
from proxy.sampling import SamplingParams, StructuredOutputParams
from proxy.tools import ToolCallParser
from proxy.tools.request import ChatTools, template_messages, tool_system_prompt

from .choice_output import ChoiceOutput
from .features import PROMPTED_TOOL_PARSER, ModelFeatures
from .reasoning_controls import after_reasoning, template_kwargs, thinking_budget, with_past_reasoning

T = TypeVar("T")
LARGE_PROMPT_CHARS = 4096
"""Prompts longer than this are tokenized in a worker thread, off the event loop."""

_KIND_METRIC = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
                "grammar": "grammar"}


@dataclass(frozen=True)
class PreparedRequest:
    """Everything one generating request needs after validation, whatever its endpoint.

    Attributes:
        prompt_ids: the prompt's token ids (the rendered chat template, or the completion prompt).
        params: sampling parameters, ``max_tokens`` resolved, the grammar attached when constrained.
        n: choices to generate.
        stream: ``stream`` / ``stream_options``.
        tools: the request's tools when their output must be split (``tool_choice`` not ``none``).
        tool_parser: the parser of ``tool_choice: "auto"`` output; None for other choices.
        reasoning_parser: the model's reasoning format (``proxy.reasoning``); None: off.
        starts_in_reasoning: the rendered prompt opened the thinking (the output starts inside it).
        images: the prompt's images (placeholder positions, hashes, encoder inputs); None: none.
    """

    prompt_ids: list[int]
    params: SamplingParams
    n: int
    stream: StreamOptions
    tools: ChatTools | None = None
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    starts_in_reasoning: bool = False
    images: PromptImages | None = None

    def choice_output(self) -> ChoiceOutput:
        """A fresh splitter for one choice's text (reasoning, content, tool calls)."""
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning = get_reasoning_parser(self.reasoning_parser, in_reasoning=self.starts_in_reasoning)
        return ChoiceOutput(self.tools, self.tool_parser, reasoning)


def check_model(client: EngineClient, requested: str) -> None:
    """Raises ModelNotFoundError (404, ``param: "model"``) unless ``requested`` is the served id."""
    served = client.model.served_model_name
    if requested != served:
        raise ModelNotFoundError(f"The model '{requested}' does not exist; this server serves '{served}'.",
                                 param="model")


async def _tokenize(func: Callable[[], T], size: int) -> T:
    return await asyncio.to_thread(func) if size > LARGE_PROMPT_CHARS else func()


def _with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{text}\n\n{messages[0]['content']}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _tool_prompt(chat: ChatCompletionRequest, features: ModelFeatures
                 ) -> tuple[list[dict[str, Any]], dict[str, Any], str | None]:
    """(template messages, template kwargs, the ``auto`` parser) of a chat request's tools.

    With ``tools``: the tools go to the chat template (``tools=``), or, for a template without tool
    support, into a system message (:func:`~proxy.tools.request.tool_system_prompt`; for ``auto`` it
    teaches :data:`PROMPTED_TOOL_PARSER`'s format and the answer goes through that parser).

    Raises:
        InvalidRequestError: ``auto`` on a template whose call format no parser reads.
    """
    tools = chat.tools
    parser = features.tool_parser
    prompted = tools is not None and tools.is_parsed and not features.template_has_tools
    if prompted:
        parser = parser or PROMPTED_TOOL_PARSER
    messages = template_messages([dict(m) for m in chat.messages], list(chat.raw_messages),
                                 template_has_tools=features.template_has_tools,
                                 call_format=parser if prompted else None)
    with_past_reasoning(messages, chat.raw_messages)
    kwargs = template_kwargs(chat, features)
    if tools is None:
        return messages, kwargs, parser
    if tools.is_parsed and parser is None:
        raise InvalidRequestError(
            "This model's chat template renders tools in a format no tool-call parser here reads, so "
            "tool_choice 'auto' cannot be served; start the server with --tool-call-parser, or use "
            "tool_choice 'required' or a named function (enforced with a grammar).", param="tool_choice")
    if features.template_has_tools:
        kwargs["tools"] = tools.template_tools()
    elif tools.is_constrained or prompted:
        messages = _with_system(messages, tool_system_prompt(tools, parser))
    return messages, kwargs, parser


async def _constrain(client: EngineClient, params: SamplingParams, so: StructuredOutputParams | None,
                     param: str, metric_kind: str) -> SamplingParams:
    """``params`` with the grammar of ``so`` compiled and attached (unchanged when ``so`` is None)."""
    if so is None:
        return params
    await client.prepare_structured_output(so, param)
    client.metrics.observe_structured_output(metric_kind)
    return replace(params, structured_outputs=so)


async def _with_grammar(chat: ChatCompletionRequest, client: EngineClient, params: SamplingParams,
                        reasoning: str | None, prompt_text: str) -> SamplingParams:
    """``params`` with the grammar of a ``required`` / named tool choice or of ``response_format``
    compiled and attached, gated to start after the thinking (``after_reasoning``)."""
    tools = chat.tools
    if tools is not None and tools.is_constrained:
        kind = "tool_named" if tools.choice.mode == "named" else "tool_required"
        so = tools.grammar()
        so = after_reasoning(so, client.tokenizer, reasoning, prompt_text) if so is not None else None
        return await _constrain(client, params, so, "tools", kind)
    if chat.structured is not None:
        so = after_reasoning(chat.structured, client.tokenizer, reasoning, prompt_text)
        return await _constrain(client, params, so, chat.structured_param or "response_format",
                                _KIND_METRIC[chat.structured.kind])
    return params


def check_images(chat: ChatCompletionRequest, client: EngineClient, features: ModelFeatures) -> None:
    """Refuse the request's images when the served model reads text only (a vision-language model
    served as a text model says why: ``ModelInfo.images_refused``).

    Raises:
        InvalidRequestError: naming the first image part (``messages[0].content[1]``).
    """
    if chat.images and not features.accepts_images:
        param = chat.images[0].param
        why = client.model.images_refused or "reads text only (it is not a vision-language model)"
        raise InvalidRequestError(f"'{param}' is an image, but the model '{client.model.served_model_name}' "
                                  f"{why}.", param=param)


@dataclass(frozen=True)
class RenderedChat:
    """A chat through the template: ``text`` (the rendered prompt), ``prompt_ids``, ``parser`` (the
    ``auto`` tool parser) and ``images`` (its images, their placeholders expanded in ``prompt_ids``;
    None without images)."""

    text: str
    prompt_ids: list[int]
    parser: str | None
    images: PromptImages | None = None


async def _with_images(chat: ChatCompletionRequest, client: EngineClient, features: ModelFeatures,
                       text: str) -> tuple[list[int], PromptImages]:
    """The prompt ids of ``text`` with the chat's images fetched, decoded and expanded into their
    placeholder tokens by the model's processor (off the event loop)."""
    vision = client.vision
    assert vision is not None  # check_images refused images for a text model
    loaded = await load_images(chat.images, features.media)
    return await asyncio.to_thread(vision.prompt, text, loaded)


async def render_chat(chat: ChatCompletionRequest, client: EngineClient, features: ModelFeatures, *,
                      add_generation_prompt: bool = True, continue_final_message: bool = False,
                      add_special_tokens: bool = False) -> RenderedChat:
    """A chat's messages and tools through the chat template (:func:`_tool_prompt`), then tokenized,
    its images (a vision model's) fetched, decoded and expanded into placeholder tokens by the model's
    processor; the one rendering :func:`prepare_chat` (and so generation), the render endpoints and
    ``/tokenize`` share. The defaults are generation's; ``continue_final_message`` leaves the last
    message open (transformers' flag, vLLM's name); ``add_special_tokens`` adds the tokenizer's BOS
    etc. on top of the template's (text-only prompts).

    Raises:
        InvalidRequestError: the template rejects the messages, ``auto`` tools cannot be parsed, an
            image is sent to a model that reads text only (400, :func:`check_images`), or an image
            cannot be fetched or decoded (``proxy.media``; naming its part).
    """
    check_images(chat, client, features)
    messages, template_kwargs, parser = _tool_prompt(chat, features)
    if continue_final_message:
        template_kwargs["continue_final_message"] = True
    size = sum(len(str(m.get("content") or "")) for m in messages)
    tokenizer = client.tokenizer
    text = await _tokenize(lambda: tokenizer.render_chat_template(
        messages, add_generation_prompt=add_generation_prompt, **template_kwargs), size)
    if chat.images:
        prompt_ids, images = await _with_images(chat, client, features, text)
        return RenderedChat(text, prompt_ids, parser, images)
    prompt_ids = await _tokenize(lambda: tokenizer.encode(text, add_special_tokens=add_special_tokens), size)
    return RenderedChat(text, prompt_ids, parser)


async def prepare_chat(chat: ChatCompletionRequest, client: EngineClient, features: ModelFeatures, *,
                       compile_grammar: bool = True,
                       context_names: tuple[str, str] = ("messages", "max_tokens"),
                       continue_final_message: bool = False) -> PreparedRequest:
    """A validated chat request -> its :class:`PreparedRequest`.

    ``required`` / named tool choices and ``response_format`` are enforced with a grammar compiled
    off the event loop here, before the request is submitted. ``compile_grammar=False`` (the render
    endpoints, which generate nothing) skips that compile; the prompt ids are the same.
    ``context_names``: the request's names of the prompt and of ``max_tokens`` in a context-length
    error (the Responses API's ``("input", "max_output_tokens")``). ``continue_final_message``: the
    output continues the last (assistant) message instead of starting a new turn (the Messages API's
    prefill; :func:`render_chat`).

    Raises:
        ModelNotFoundError: ``model`` is not the served model (404).
        InvalidRequestError: the template rejects the messages, ``auto`` tools cannot be parsed, the
            grammar or ``thinking_token_budget`` cannot be enforced, or prompt + ``max_tokens`` exceed
            the context (400).
    """
    check_model(client, chat.model)
    rendered = await render_chat(chat, client, features, add_generation_prompt=not continue_final_message,
                                 continue_final_message=continue_final_message)
    text, prompt_ids, parser = rendered.text, rendered.prompt_ids, rendered.parser
    tokenizer = client.tokenizer
    prompt_name, max_tokens_name = context_names
    max_tokens = protocol.resolve_max_tokens(chat.max_tokens, len(prompt_ids), client.model.max_model_len,
                                             prompt_name=prompt_name, max_tokens_name=max_tokens_name)
    params = replace(chat.params, max_tokens=max_tokens)
    tools = chat.tools
    markers: tuple[str, ...] = ()
    if tools is not None and tools.is_parsed and parser is not None:
        markers += ToolCallParser(parser).marker_texts
    reasoning = features.reasoning_parser
    starts_inside = False
    if reasoning is not None:
        markers += get_reasoning_format(reasoning).marker_texts
        starts_inside = starts_in_reasoning(reasoning, text[-64:])
        params = replace(params, reasoning_parser=reasoning, starts_in_reasoning=starts_inside)
    if chat.thinking_token_budget is not None:
        params = replace(params, thinking_budget=thinking_budget(
            chat.thinking_token_budget, tokenizer, reasoning, starts_inside))
    # the parsers' markers stay in the text where they are special tokens (Mistral's [TOOL_CALLS])
    keep = tokenizer.special_ids_of(markers) if markers else frozenset()
    if keep:
        params = replace(params, keep_special_ids=keep)
    if compile_grammar:
        params = await _with_grammar(chat, client, params, reasoning, text)
    active = tools if tools is not None and tools.choice.mode != "none" else None
    return PreparedRequest(prompt_ids, params, chat.n, chat.stream, active, parser if active else None,
                           reasoning, starts_inside, rendered.images)


async def prepare_completion(cmpl: CompletionRequest, client: EngineClient) -> PreparedRequest:
    """A validated legacy completion request -> its :class:`PreparedRequest`.

    Raises:
        ModelNotFoundError: ``model`` is not the served model (404).
        InvalidRequestError: prompt + ``max_tokens`` exceed the context (400).
    """
    check_model(client, cmpl.model)
    prompt = cmpl.prompt
    if isinstance(prompt, tuple):
        prompt_ids = list(prompt)
    else:
        prompt_ids = await _tokenize(lambda: client.tokenizer.encode(prompt), len(prompt))
    max_tokens = protocol.resolve_max_tokens(cmpl.max_tokens, len(prompt_ids), client.model.max_model_len,
                                             prompt_name="prompt")
    return PreparedRequest(prompt_ids, replace(cmpl.params, max_tokens=max_tokens), cmpl.n, cmpl.stream)
