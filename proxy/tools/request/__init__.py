"""The OpenAI request fields of tool calling and structured outputs: validation, prompts, grammars.

Covers ``response_format`` (``text``, ``json_object``, ``json_schema``), ``tools``, ``tool_choice``
(``"none"``, ``"auto"``, ``"required"``, ``{"type": "function", "function": {"name"}}``),
``parallel_tool_calls``, vLLM's extras ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` / ``structured_outputs``, and the chat history of an agent loop (assistant
messages with ``tool_calls``, ``tool`` messages with ``tool_call_id``). Every invalid value is an
:class:`~proxy.errors.InvalidRequestError` (400) whose ``param`` names the field.

How a tool choice is served (as vLLM does):

- ``"none"``: plain text; tools are still shown to the template.
- ``"auto"``: the model decides; its output is parsed by a :class:`~proxy.tools.ToolCallParser`
  (the template's format, or on a template without tool support the format the system prompt
  teaches, as llama.cpp's server serves tools on any template).
- ``"required"``: the output is constrained by a grammar to a JSON array of
  ``{"name": <a tool>, "parameters": <its schema>}`` (one element when ``parallel_tool_calls`` is
  false), so even a small model returns calls whose arguments validate.
- a named function: the output is constrained to that function's ``parameters`` schema; it is the
  arguments object itself.

On a chat template without tool support, :func:`tool_system_prompt` describes the tools in a system
message (the README documents its text): for ``"required"`` and named choices the JSON the grammar
forces; for ``"auto"`` one tool-call format that a parser reads (``hermes``'s ``<tool_call>`` unless
``--tool-call-parser`` names another), with no grammar, so the model may answer in text instead.

The package, one concept a module: :mod:`~proxy.tools.request.structured_outputs`
(``response_format`` and ``guided_*``), :mod:`~proxy.tools.request.chat_tools` (``tools`` and
``tool_choice``, and the grammar of a constrained choice), :mod:`~proxy.tools.request.prompt` (the
tool system prompt), :mod:`~proxy.tools.request.messages` (the agent loop's messages) and
:mod:`~proxy.tools.request.field_errors` (the 400 they raise).
"""

from proxy.tools.request.chat_tools import ChatTools, ToolChoice, ToolSpec, parse_chat_tools
from proxy.tools.request.messages import template_messages
from proxy.tools.request.prompt import tool_system_prompt
from proxy.tools.request.structured_outputs import parse_structured_outputs

__all__ = [
    "ChatTools",
    "ToolChoice",
    "ToolSpec",
    "parse_chat_tools",
    "parse_structured_outputs",
    "template_messages",
    "tool_system_prompt",
]
