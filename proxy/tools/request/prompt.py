"""The system text that presents the tools to a model whose chat template cannot (no tool support).

Its exact text is documented in the README: for ``required`` and named choices the JSON the grammar
forces; for ``auto`` one tool-call format that a parser reads.
"""

from __future__ import annotations

import json

from proxy.tools.parsers import CALL_SHAPES
from proxy.tools.request.chat_tools import ChatTools

__all__ = ["tool_system_prompt"]


def tool_system_prompt(tools: ChatTools, parser_name: str | None = None) -> str:
    """The system text that presents the tools when the chat template cannot (no tool support).

    Args:
        tools: the request's tools; ``required`` and named choices get the shape their grammar
            forces, ``auto`` the call format of ``parser_name``.
        parser_name: the tool-call parser that reads an ``auto`` answer (``hermes`` when None).
    """
    listing = "\n".join(json.dumps(t.to_template()["function"], ensure_ascii=False) for t in tools.tools
                        if tools.choice.mode != "named" or t.name == tools.choice.name)
    if tools.choice.mode == "named":
        return (
            f"You have access to the following function:\n{listing}\n"
            f"Call the function {tools.choice.name} now: answer only with its arguments as a JSON object."
        )
    if tools.choice.mode == "auto":
        shape = CALL_SHAPES[parser_name or "hermes"]
        return (
            f"You have access to the following functions:\n{listing}\n"
            f"To call a function, answer with\n{shape}\nIf no function is needed, answer the user directly."
        )
    return (f"You have access to the following functions:\n{listing}\n"
            'Call one or more of them now: answer only with a JSON array of calls, each '
            '{"name": <function name>, "parameters": <arguments object>}.')

