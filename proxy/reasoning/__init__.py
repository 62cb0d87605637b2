"""Reasoning parsers: one choice's output text -> the thinking (``reasoning_content``) and the answer.

Thinking models write their reasoning before the answer, marked by tags (``<think>...</think>``,
``[THINK]...[/THINK]``) or, for GPT-OSS, on harmony's ``analysis`` channel. A parser per choice reads
the streamed output text (after the stop checker, before the tool-call parser) and splits each delta
into a reasoning part and a content part, holding back text that may be the start of a marker, so
no marker fragment reaches a client and streaming equals non-streaming for any chunking. Names and
behaviour follow vLLM's ``--reasoning-parser`` (``deepseek_r1``, ``qwen3``, ``mistral``, ``gpt_oss``
/ ``openai_gptoss``). Pure Python, stdlib only; why it is not in ``ext/`` is in ``docs/internals.md``.

Use (the request pipeline):

    name = resolve_reasoning_parser(settings.reasoning_parser, chat_template)   # once per model
    keep = tokenizer.special_ids_of(get_reasoning_format(name).marker_texts)     # detokenizer keeps
    start = starts_in_reasoning(name, prompt_text_tail)                          # per request
    parser = get_reasoning_parser(name, in_reasoning=start)                      # per choice
    reasoning_delta, content_delta = parser.feed(text); ...; parser.flush()

Modules: :mod:`~proxy.reasoning.base` (the interface and the hold-back rule),
:mod:`~proxy.reasoning.think` (tag pairs), :mod:`~proxy.reasoning.harmony` (GPT-OSS channels),
:mod:`~proxy.reasoning.registry` (names, markers, detection).
"""

from proxy.reasoning.base import ReasoningParser, ReasoningResult, held_prefix_len
from proxy.reasoning.harmony import HarmonyParser
from proxy.reasoning.registry import (
    OFF,
    REASONING_FORMATS,
    REASONING_PARSERS,
    ReasoningFormat,
    check_reasoning_parser_setting,
    detect_reasoning_parser,
    get_reasoning_format,
    get_reasoning_parser,
    reasoning_parser_names,
    resolve_reasoning_parser,
    starts_in_reasoning,
)
from proxy.reasoning.think import ThinkTagParser

__all__ = [
    "OFF",
    "REASONING_FORMATS",
    "REASONING_PARSERS",
    "HarmonyParser",
    "ReasoningFormat",
    "ReasoningParser",
    "ReasoningResult",
    "ThinkTagParser",
    "check_reasoning_parser_setting",
    "detect_reasoning_parser",
    "get_reasoning_format",
    "get_reasoning_parser",
    "held_prefix_len",
    "reasoning_parser_names",
    "resolve_reasoning_parser",
    "starts_in_reasoning",
]
