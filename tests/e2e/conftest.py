"""The e2e suite's server fixture: a real uvicorn with the default model (see server.py), once per
engine mode (``--no-engine-process`` / ``--engine-process``), as uvicorn's tests run both HTTP
implementations; pytest groups the tests by mode, so one server of each mode runs at a time."""

from __future__ import annotations

import pytest

from .server import Server, get_server


# The default model's e2e suite runs on the engine thread only, for now: engine-process mode was
# measured far slower on CPU (the child steps torch on its main thread) and this suite has never
# completed in that mode. Process mode is covered by tests/api/test_real_engine.py and
# tests/production/test_engine_process.py (SIGKILL mid-stream, restart).
@pytest.fixture(scope="session", params=[False], ids=["engine-thread"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Server:
    return get_server(tmp_path_factory.mktemp("e2e"), engine_process=bool(request.param))
