"""What the served model supports, read once from its tokenizer when it is loaded."""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.media.fetch import MediaPolicy
from proxy.reasoning import resolve_reasoning_parser
from proxy.tokenizer import Tokenizer
from proxy.tools import detect_parser

PROMPTED_TOOL_PARSER = "hermes"
"""The call format taught by the system prompt on a chat template without tool support (unless
``--tool-call-parser`` names another): explicit open and close markers, so text around a call
streams as content, and the format of the Hermes and Qwen fine-tunes."""


@dataclass(frozen=True)
class ModelFeatures:
    """The served model's chat capabilities.

    Attributes:
        has_chat_template: the tokenizer has a chat template (else chat requests are a 400).
        template_has_tools: the template renders ``tools``, assistant ``tool_calls`` and ``tool``
            messages itself (it mentions ``tools``, or its tool-call format was detected).
        tool_parser: the parser of ``tool_choice: "auto"`` output: ``--tool-call-parser``, else the
            format detected in the template (``proxy.tools.detect_parser``); None: neither.
        reasoning_parser: the ``--reasoning-parser`` format of the model's thinking, else the one
            detected in the template (``proxy.reasoning.resolve_reasoning_parser``); None: off.
        reasoning_detected: ``reasoning_parser`` came from the template, not the setting.
        template_thinks: the template reads ``enable_thinking`` (Qwen3-style thinking switch).
        accepts_images: the model is a vision-language model served with its images; False: an
            image part is a 400 naming it (:func:`proxy.pipeline.prepare.render_chat`).
        media: where image URLs may be fetched from and how big images may be (the server's
            ``--allowed-media-domains``, ``--allowed-local-media-path``, ``--media-fetch-timeout-s``).
    """

    has_chat_template: bool = False
    template_has_tools: bool = False
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    reasoning_detected: bool = False
    template_thinks: bool = False
    accepts_images: bool = False
    media: MediaPolicy = field(default_factory=MediaPolicy)

    @classmethod
    def detect(cls, tokenizer: Tokenizer, tool_call_parser: str = "", reasoning_parser: str = "", *,
               accepts_images: bool = False, media: MediaPolicy | None = None) -> ModelFeatures:
        """Read the features from ``tokenizer``'s chat template; ``tool_call_parser`` and
        ``reasoning_parser`` are the ``--tool-call-parser`` / ``--reasoning-parser`` settings
        ("" = detect; ``none`` turns reasoning off); ``accepts_images`` and ``media`` are kept as
        given (the engine client's ``vision``; the server's media options).

        Raises:
            ValueError: an unknown reasoning parser name (the message lists the names).
        """
        template = getattr(tokenizer.hf_tokenizer, "chat_template", None)
        template = template if isinstance(template, str) else None
        detected = detect_parser(template)
        has_tools = detected is not None or (template is not None and "tools" in template)
        reasoning = resolve_reasoning_parser(reasoning_parser, template)
        return cls(template is not None, has_tools, tool_call_parser or detected, reasoning,
                   reasoning is not None and not reasoning_parser,
                   template is not None and "enable_thinking" in template, accepts_images,
                   media or MediaPolicy())
