"""The OpenAI Responses API (``/v1/responses``) on the request pipeline chat completions use.

:mod:`~proxy.api.responses_api.routes` (the endpoints), :mod:`~proxy.api.responses_api.run` (one
response generated: JSON body or event stream), :mod:`~proxy.api.responses_api.output` (output items
and their events, from the choice's parts), :mod:`~proxy.api.responses_api.body` (the ``response``
object), :mod:`~proxy.api.responses_api.store` (stored responses for ``previous_response_id`` and
``item_reference``) and :mod:`~proxy.api.responses_api.input_items` (the input items listed, paged).
"""

from proxy.api.responses_api.store import ResponseStore

__all__ = ["ResponseStore"]
