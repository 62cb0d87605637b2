"""The e2e suite's server fixture: a real uvicorn with the default model (see server.py)."""

from __future__ import annotations

import pytest

from .server import Server, get_server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Server:
    return get_server(tmp_path_factory.mktemp("e2e"))
