"""The OpenAI wire format: request schemas and validation (``requests``, ``fields``, ``embeddings``),
the context check (``context``) and the response bodies and logprob formatting (``responses``).
Import names from here. The Responses API (``responses_request``, ``responses_items``) and
Anthropic's Messages API (``messages_request``, ``messages_content``) are translations into the chat
request, imported from their modules."""

from __future__ import annotations

from .chat_messages import CHAT_ROLES
from .context import resolve_max_tokens
from .embeddings import (
    ENCODING_FORMATS,
    EmbeddingRequest,
    embedding_response,
    encode_embedding,
    parse_embedding_request,
)
from .fields import StreamOptions, parse_json_body
from .images import ImagePart
from .requests import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_TOP_LOGPROBS,
    UNSUPPORTED_CHAT_FIELDS,
    UNSUPPORTED_COMPLETION_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    choice_params,
    parse_chat_request,
    parse_completion_request,
)
from .responses import (
    CHAT,
    COMPLETION,
    LOGPROB_FLOOR,
    ChoiceResult,
    CompletionFormat,
    LogprobEntry,
    Usage,
    chat_logprobs,
    completion_logprobs,
    model_card,
)

__all__ = [
    "CHAT",
    "CHAT_ROLES",
    "COMPLETION",
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "ENCODING_FORMATS",
    "LOGPROB_FLOOR",
    "MAX_TOP_LOGPROBS",
    "UNSUPPORTED_CHAT_FIELDS",
    "UNSUPPORTED_COMPLETION_FIELDS",
    "ChatCompletionRequest",
    "ChoiceResult",
    "CompletionFormat",
    "CompletionRequest",
    "EmbeddingRequest",
    "ImagePart",
    "LogprobEntry",
    "StreamOptions",
    "Usage",
    "chat_logprobs",
    "choice_params",
    "completion_logprobs",
    "embedding_response",
    "encode_embedding",
    "model_card",
    "parse_chat_request",
    "parse_completion_request",
    "parse_embedding_request",
    "parse_json_body",
    "resolve_max_tokens",
]
