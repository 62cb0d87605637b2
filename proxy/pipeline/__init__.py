"""The request pipeline: one path from a validated request to engine input, and from engine output to
the parts every wire format writes (no Starlette; shared by every generating endpoint).

- :mod:`~proxy.pipeline.features`: what the served model supports (tools in its template, the
  tool-call parser), computed once at load.
- :mod:`~proxy.pipeline.prepare`: a parsed chat or completion request -> a :class:`PreparedRequest`
  (prompt ids, sampling parameters, tools and their parser, the structured-output grammar compiled).
- :mod:`~proxy.pipeline.choice_output`: one choice's text deltas -> reasoning, content and tool-call
  deltas (:class:`ChoiceOutput`), the same split for a stream and a whole body.

An endpoint is parse -> prepare -> ``EngineClient.generate`` -> its wire format
(``proxy.api.completion``).
"""

from proxy.pipeline.choice_output import ChoiceOutput, ChoiceParts
from proxy.pipeline.features import PROMPTED_TOOL_PARSER, ModelFeatures
from proxy.pipeline.prepare import PreparedRequest, check_model, prepare_chat, prepare_completion, render_chat

__all__ = [
    "PROMPTED_TOOL_PARSER",
    "ChoiceOutput",
    "ChoiceParts",
    "ModelFeatures",
    "PreparedRequest",
    "check_model",
    "prepare_chat",
    "prepare_completion",
    "render_chat",
]
