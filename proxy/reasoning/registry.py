"""The reasoning formats by name: which parser, which markers, where the output starts, detection.

Names are vLLM's ``--reasoning-parser`` names (:data:`REASONING_PARSERS`; vLLM's ``openai_gptoss`` is
accepted for ``gpt_oss``). A format is chosen once per model: by the setting, else
:func:`detect_reasoning_parser` on the chat template; per request, :func:`starts_in_reasoning` on the
rendered prompt's tail says whether the output begins inside the thinking, and
:func:`get_reasoning_parser` makes one parser per choice.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.reasoning.base import ReasoningParser
from proxy.reasoning.harmony import ANALYSIS_OPEN, HARMONY_MARKERS, HarmonyParser
from proxy.reasoning.think import ThinkTagParser

__all__ = [
    "OFF",
    "REASONING_FORMATS",
    "REASONING_PARSERS",
    "ReasoningFormat",
    "check_reasoning_parser_setting",
    "detect_reasoning_parser",
    "get_reasoning_format",
    "get_reasoning_parser",
    "reasoning_parser_names",
    "resolve_reasoning_parser",
    "starts_in_reasoning",
]


@dataclass(frozen=True)
class ReasoningFormat:
    """One reasoning format.

    Attributes:
        name: the parser name.
        open_marker: text that opens the reasoning (a prompt ending with it starts the output inside).
        close_marker: text that ends it ("" for harmony, whose reasoning ends with its message).
        marker_texts: every marker the parser reads; where the vocabulary has one as a special token
            the detokenizer must keep it as text (``Tokenizer.special_ids_of(marker_texts)`` ->
            ``SamplingParams.keep_special_ids``), since it drops special tokens.
        default_in_reasoning: where the output starts when the prompt's tail does not say
            (``deepseek_r1``: inside the thinking, as vLLM assumes for R1 and its distills).
    """

    name: str
    open_marker: str
    close_marker: str
    marker_texts: tuple[str, ...]
    default_in_reasoning: bool = False

    def new_parser(self, in_reasoning: bool | None = None) -> ReasoningParser:
        """A fresh parser for one choice; ``in_reasoning`` None: :attr:`default_in_reasoning`."""
        start = self.default_in_reasoning if in_reasoning is None else in_reasoning
        if self.name == "gpt_oss":
            return HarmonyParser(in_reasoning=start)
        return ThinkTagParser(self.open_marker, self.close_marker, in_reasoning=start)

    def starts_in_reasoning(self, prompt_tail: str) -> bool:
        """Whether the output of a prompt ending with ``prompt_tail`` (the rendered prompt text, or
        its last few tokens decoded with special tokens kept) starts inside the reasoning.

        True when the tail, whitespace stripped, ends with the open marker (Qwen3 thinking and
        DeepSeek-R1 templates end the generation prompt with ``<think>\\n``); False when it ends with
        the close marker (thinking turned off: Qwen3's ``enable_thinking=False`` renders
        ``<think>\\n\\n</think>\\n\\n``); else :attr:`default_in_reasoning`.
        """
        tail = prompt_tail.rstrip()
        if tail.endswith(self.open_marker):
            return True
        if self.close_marker and tail.endswith(self.close_marker):
            return False
        return self.default_in_reasoning


_THINK = ("<think>", "</think>")
REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat("deepseek_r1", *_THINK, _THINK, default_in_reasoning=True),
    "qwen3": ReasoningFormat("qwen3", *_THINK, _THINK),
    "mistral": ReasoningFormat("mistral", "[THINK]", "[/THINK]", ("[THINK]", "[/THINK]")),
    "gpt_oss": ReasoningFormat("gpt_oss", ANALYSIS_OPEN, "", HARMONY_MARKERS),
}
"""The formats by canonical name."""

REASONING_PARSERS: tuple[str, ...] = tuple(REASONING_FORMATS)
"""The canonical parser names (``--reasoning-parser``)."""

_ALIASES = {"openai_gptoss": "gpt_oss"}  # vLLM's own name for the harmony parser
OFF = "none"
"""The setting value that turns reasoning parsing off."""


def reasoning_parser_names() -> tuple[str, ...]:
    """Every accepted name, sorted: the canonical ones and vLLM's aliases (``openai_gptoss``)."""
    return tuple(sorted((*REASONING_PARSERS, *_ALIASES)))


def get_reasoning_format(name: str) -> ReasoningFormat:
    """The format of parser ``name`` (canonical or alias).

    Raises:
        ValueError: unknown name; the message lists the names.
    """
    fmt = REASONING_FORMATS.get(_ALIASES.get(name, name))
    if fmt is None:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{', '.join(reasoning_parser_names())} (or {OFF!r} for none)")
    return fmt


def get_reasoning_parser(name: str, *, in_reasoning: bool | None = None) -> ReasoningParser:
    """A new parser for one choice by name; ``in_reasoning`` None: the format's default (pass
    :func:`starts_in_reasoning` of the prompt).

    Raises:
        ValueError: unknown name.
    """
    return get_reasoning_format(name).new_parser(in_reasoning)


def starts_in_reasoning(name: str, prompt_tail: str) -> bool:
    """:meth:`ReasoningFormat.starts_in_reasoning` of parser ``name``.

    Raises:
        ValueError: unknown name.
    """
    return get_reasoning_format(name).starts_in_reasoning(prompt_tail)


def detect_reasoning_parser(chat_template: str | None) -> str | None:
    """The reasoning parser a chat template's text calls for, or None.

    GPT-OSS templates print ``<|channel|>`` -> ``gpt_oss``; Magistral's ``[THINK]`` -> ``mistral``;
    a ``<think>`` / ``</think>`` template -> ``deepseek_r1`` when it is DeepSeek's (its role markers
    ``<｜Assistant｜>`` use U+FF5C), else ``qwen3`` (Qwen3, QwQ, SmolLM3, GLM: no tags in the
    output means no reasoning).
    """
    if not chat_template:
        return None
    if "<|channel|>" in chat_template:
        return "gpt_oss"
    if "[THINK]" in chat_template:
        return "mistral"
    if "<think>" in chat_template or "</think>" in chat_template:
        return "deepseek_r1" if "\uff5cAssistant\uff5c" in chat_template else "qwen3"
    return None


def resolve_reasoning_parser(setting: str, chat_template: str | None) -> str | None:
    """The parser of a model: ``setting`` (``--reasoning-parser``) "" -> detected from the template,
    ``"none"`` -> None (off), a name -> its canonical name.

    Raises:
        ValueError: unknown name.
    """
    if setting == OFF:
        return None
    if not setting:
        return detect_reasoning_parser(chat_template)
    return get_reasoning_format(setting).name


def check_reasoning_parser_setting(setting: str) -> None:
    """Refuse an unknown ``--reasoning-parser`` value at start ("" and ``"none"`` are accepted).

    Raises:
        ValueError: unknown name; the message names the flag and lists the names.
    """
    if setting in ("", OFF):
        return
    try:
        get_reasoning_format(setting)
    except ValueError as exc:
        raise ValueError(f"--reasoning-parser: {exc}") from None
