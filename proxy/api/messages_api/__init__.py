"""The Anthropic Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) on the request
pipeline chat completions use.

:mod:`~proxy.api.messages_api.routes` (the endpoints), :mod:`~proxy.api.messages_api.run` (one
message generated: JSON body or event stream), :mod:`~proxy.api.messages_api.output` (content blocks
and their events, from the choice's parts), :mod:`~proxy.api.messages_api.body` (the ``message``
object, ``usage``, ``stop_reason``) and :mod:`~proxy.api.messages_api.errors` (Anthropic's error
envelope and statuses). The request side is :mod:`proxy.protocol.messages_request`.
"""
