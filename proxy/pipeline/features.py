"""What the served model supports, read once from its tokenizer when it is loaded."""

from __future__ import annotations

from dataclasses import dataclass

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
    """

    has_chat_template: bool = False
    template_has_tools: bool = False
    tool_parser: str | None = None

    @classmethod
    def detect(cls, tokenizer: Tokenizer, tool_call_parser: str = "") -> ModelFeatures:
        """Read the features from ``tokenizer``'s chat template; ``tool_call_parser`` is the
        ``--tool-call-parser`` setting ("" = detect)."""
        template = getattr(tokenizer.hf_tokenizer, "chat_template", None)
        template = template if isinstance(template, str) else None
        detected = detect_parser(template)
        has_tools = detected is not None or (template is not None and "tools" in template)
        return cls(template is not None, has_tools, tool_call_parser or detected)
