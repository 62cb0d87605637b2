"""The finish rule of a sampled token: :func:`check_stop` (vLLM v1's ``check_stop``).

Stop strings are not here: they need text, which is the API side's job (it aborts the request).
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet

from proxy.engine.request import FinishReason, Request


def check_stop(
    request: Request, token: int, eos_token_ids: AbstractSet[int], max_model_len: int
) -> FinishReason | None:
    """Whether ``request`` finishes now that ``token`` (already appended) is its newest output token.

    Args:
        request: the request, its ``output_token_ids`` ending with ``token``.
        token: the sampled token id.
        eos_token_ids: ids that end a sequence unless ``params.ignore_eos``.
        max_model_len: longest prompt + output in tokens.

    Returns:
        "stop" on an EOS id (unless ``ignore_eos``) or a ``stop_token_ids`` id once ``min_tokens``
        other tokens are out (``SamplingParams.is_stop_allowed``, the one ``min_tokens`` rule); then
        ``request.stop_reason`` is set to ``token``. "length" at ``max_tokens`` output tokens or when
        prompt + output reach ``max_model_len``. None: the request goes on.
    """
    params = request.params
    num_out = len(request.output_token_ids)
    if params.is_stop_allowed(num_out - 1) and (
        (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
    ):
        request.stop_reason = token
        return "stop"
    if num_out >= params.max_tokens or request.num_tokens >= max_model_len:
        return "length"
    return None
