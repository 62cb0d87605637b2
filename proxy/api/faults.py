"""Test-only fault injection: make engine forward passes raise on demand.

Off by default. ``create_app(..., enable_test_faults=True)`` (the CLI sets it when the
environment variable ``STREAMPROXY_TEST_FAULTS=1`` is present; there is deliberately no command
line option) adds the route ``POST /_test/fault`` with a JSON body
``{"after_steps": N, "fail_steps": K}``: the next ``N`` forward passes run normally, the ``K``
after them raise :class:`InjectedFault`, then the injector disarms itself. The engine turns each
failing step into ``finish_reason="error"`` for that step's requests (``AsyncEngine.fault_injector``,
docs/internals.md), so the affected streams end with an SSE error event and ``[DONE]`` while the
server keeps serving.
"""

from __future__ import annotations

import threading
from typing import Any


class InjectedFault(RuntimeError):
    """The exception an armed :class:`FaultInjector` raises inside a forward pass."""


class FaultInjector:
    """A callable for ``AsyncEngine.fault_injector``; runs on the engine thread, armed from the event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._skip = 0
        self._fail = 0
        self.num_raised = 0

    def arm(self, after_steps: int = 0, fail_steps: int = 1) -> None:
        """Let ``after_steps`` forward passes through, then fail the next ``fail_steps`` ones.

        Raises:
            ValueError: a negative count.
        """
        if after_steps < 0 or fail_steps < 0:
            raise ValueError("after_steps and fail_steps must be >= 0")
        with self._lock:
            self._skip, self._fail = after_steps, fail_steps

    @property
    def is_armed(self) -> bool:
        return self._fail > 0

    def __call__(self) -> None:
        with self._lock:
            if self._fail <= 0:
                return
            if self._skip > 0:
                self._skip -= 1
                return
            self._fail -= 1
            self.num_raised += 1
        raise InjectedFault("injected fault (test hook)")


def parse_arm_body(body: Any) -> tuple[int, int]:
    """``(after_steps, fail_steps)`` from the JSON body of ``POST /_test/fault``.

    Raises:
        ValueError: not an object of non-negative integers.
    """
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")  # noqa: TRY004 - a 400 for the client
    values = []
    for name, default in (("after_steps", 0), ("fail_steps", 1)):
        v = body.get(name, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"'{name}' must be a non-negative integer")
        values.append(v)
    return values[0], values[1]
