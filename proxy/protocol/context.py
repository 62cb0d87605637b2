"""The context check: the tokens a request may generate within the model's context window.

One rule, one place: the API calls
:func:`resolve_max_tokens` before generating and ``EngineCore.add_request`` calls it again.
"""

from __future__ import annotations

from proxy.errors import ContextLengthExceededError, InvalidRequestError

__all__ = ["resolve_max_tokens"]


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int,
                       *, prompt_name: str = "messages", max_tokens_name: str = "max_tokens") -> int:
    """The number of tokens to generate, checked against the context window: THE context check.

    The API calls it before generating (so the error is a plain 400 JSON body, also for
    ``stream: true``) and ``EngineCore.add_request`` calls it again as a guard; both give this
    message, modelled on OpenAI's ``context_length_exceeded`` error.

    Args:
        requested: the client's ``max_tokens`` or None (then: ``max_model_len - num_prompt_tokens``,
            as vLLM does).
        num_prompt_tokens: tokens of the templated prompt.
        max_model_len: the context window in tokens.
        prompt_name: ``"messages"`` (chat), ``"prompt"`` (completions) or ``"input"`` (Responses
            API), used in the message and as the error's ``param``.
        max_tokens_name: the request's name of ``requested`` (``"max_output_tokens"`` in the
            Responses API), the ``param`` of the error when prompt + requested is too long.

    Raises:
        InvalidRequestError: an empty prompt.
        ContextLengthExceededError: the prompt leaves no room, or prompt + requested exceeds the
            window; the message gives N, M, P and K like OpenAI's.
    """
    if num_prompt_tokens < 1:
        raise InvalidRequestError(f"The {prompt_name} must contain at least one token.", param=prompt_name)
    if num_prompt_tokens >= max_model_len:
        completion = requested if requested is not None else 1
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + completion} tokens ({num_prompt_tokens} in the {prompt_name}, "
            f"{completion} in the completion). Please reduce the length of the {prompt_name}.",
            param=prompt_name,
        )
    if requested is None:
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + requested > max_model_len:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the {prompt_name}, "
            f"{requested} in the completion). Please reduce the length of the {prompt_name} "
            "or the completion.",
            param=max_tokens_name,
        )
    return requested
