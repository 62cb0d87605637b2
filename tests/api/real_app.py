"""The real app (real engine, real tokenizer) in-process behind an httpx client on ASGITransport."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from proxy.api.app import create_app
from proxy.settings import Settings


@contextlib.asynccontextmanager
async def real_app(settings: Settings) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """``(client, ServerState)`` of the app for ``settings`` once its model is loaded and ready.

    The load may take seconds (an engine process imports torch afresh on a busy machine): waits up
    to 300 s. Asserts the state is ``ready`` (the load error otherwise)."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        state = app.state.server
        for _ in range(30000):
            if state.status != "loading":
                break
            await asyncio.sleep(0.01)
        assert state.status == "ready", state.load_error
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=120) as client:
            yield client, state
