"""Tool-call parsers: model output text -> content text + OpenAI ``tool_calls``.

One parser per chat-template format, with vLLM's ``--tool-call-parser`` names: ``hermes`` (Hermes,
Qwen2/2.5/3 ``<tool_call>{...}</tool_call>``), ``llama3_json`` (Llama 3.x ``{"name", "parameters"}``),
``mistral`` (``[TOOL_CALLS][{...}]``). :func:`get_parser` picks one by name,
:func:`detect_parser` from a chat template's text. Pure Python, stdlib only.
"""

from proxy.tools.parsers import (
    PARSERS,
    CallStream,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    ToolParseResult,
    detect_parser,
    get_parser,
    new_call_id,
)

__all__ = [
    "PARSERS",
    "CallStream",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolParseResult",
    "detect_parser",
    "get_parser",
    "new_call_id",
]
