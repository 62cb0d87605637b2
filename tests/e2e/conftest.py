"""The e2e suite's server fixture: a real uvicorn with the default model (see server.py), once per
engine mode (``--no-engine-process`` / ``--engine-process``), as uvicorn's tests run both HTTP
implementations; pytest groups the tests by mode, so one server works at a time (the other idles)."""

from __future__ import annotations

import pytest

from .server import Server, get_server


@pytest.fixture(scope="session", params=[False, True], ids=["engine-thread", "engine-process"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Server:
    return get_server(tmp_path_factory.mktemp("e2e"), engine_process=bool(request.param))
