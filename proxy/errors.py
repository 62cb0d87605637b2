"""Exception tree of streamproxy, each mapped to an OpenAI error object and an HTTP status.

The wire shape follows the OpenAI API reference ("Error codes"):
``{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}``.
"""

from __future__ import annotations

from typing import Any


class StreamproxyError(Exception):
    """Base class: an error that can be shown to an API client.

    Attributes:
        message: human-readable text, never a traceback or a file path.
        status: HTTP status code the API layer answers with.
        type: OpenAI error ``type`` (``invalid_request_error``, ``server_error``, ...).
        param: the request field at fault, or None.
        code: OpenAI error ``code`` (e.g. ``context_length_exceeded``), or None.
    """

    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequestError(StreamproxyError):
    """Malformed or out-of-range request (HTTP 400, ``invalid_request_error``)."""

    status = 400
    type = "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    """Prompt tokens + max_tokens exceed the model's context (HTTP 400, ``context_length_exceeded``)."""

    code = "context_length_exceeded"


class AuthenticationError(StreamproxyError):
    """Missing or wrong API key (HTTP 401)."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class NotFoundError(StreamproxyError):
    """Unknown model or route (HTTP 404)."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFoundError(NotFoundError):
    """The request names a model this server does not serve (HTTP 404, ``model_not_found``)."""

    code = "model_not_found"


class MethodNotAllowedError(StreamproxyError):
    """HTTP 405."""

    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class PayloadTooLargeError(StreamproxyError):
    """Request body over the configured limit (HTTP 413)."""

    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class UnsupportedMediaTypeError(StreamproxyError):
    """A request body in a ``Content-Encoding`` the server does not decode (HTTP 415, RFC 9110 15.5.16)."""

    status = 415
    type = "invalid_request_error"
    code = "unsupported_content_encoding"


class RateLimitError(StreamproxyError):
    """The waiting queue is full (HTTP 429, ``rate_limit_exceeded``); the client should retry later."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class ServiceUnavailableError(StreamproxyError):
    """The model is loading, the engine died, or the server shuts down (HTTP 503).

    Attributes:
        retry_after_s: seconds after which a retry may succeed (the response's ``Retry-After``,
            which the OpenAI and Anthropic SDKs wait before their retries), or None: no header.
    """

    status = 503
    type = "server_error"
    code = "service_unavailable"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message, param=param, code=code)
        self.retry_after_s = retry_after_s


class EngineError(StreamproxyError):
    """A failure inside the engine while a request ran (HTTP 500, ``server_error``)."""

    status = 500
    type = "server_error"
    code = "engine_error"


class EngineDeadError(ServiceUnavailableError):
    """The engine thread stopped; no request can be served (HTTP 503)."""

    code = "engine_dead"
