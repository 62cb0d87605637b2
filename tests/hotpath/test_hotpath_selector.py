"""The selector in proxy.hotpath: compiled unless STREAMPROXY_PURE_PYTHON=1; CI requires it compiled."""

from __future__ import annotations

import os
import subprocess
import sys

from proxy import hotpath
from proxy.hotpath import python


def test_compiled_loaded_when_required():
    """With STREAMPROXY_REQUIRE_COMPILED=1 (``make test``), a missing or broken build fails here."""
    if os.environ.get("STREAMPROXY_REQUIRE_COMPILED") != "1" or os.environ.get("STREAMPROXY_PURE_PYTHON") == "1":
        assert hotpath.IS_COMPILED == (hotpath.COMPILED_IMPORT_ERROR is None
                                       and os.environ.get("STREAMPROXY_PURE_PYTHON") != "1")
        return
    assert hotpath.IS_COMPILED, f"compiled hot path failed to import: {hotpath.COMPILED_IMPORT_ERROR}"
    assert hotpath.IncrementalDetokenizer.__module__ == "proxy.hotpath._hotpath"


def _probe(env_value: str | None) -> str:
    env = dict(os.environ)
    env.pop("STREAMPROXY_PURE_PYTHON", None)
    if env_value is not None:
        env["STREAMPROXY_PURE_PYTHON"] = env_value
    code = "import proxy.hotpath as h; print(h.IS_COMPILED, h.StopChecker.__module__)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_env_forces_pure_python():
    assert _probe("1") == "False proxy.hotpath.python"


def test_selected_names_match_twin_api():
    for name in ("DecodeTable", "IncrementalDetokenizer", "StopChecker", "ChunkFramer", "dumps"):
        assert getattr(hotpath, name).__name__ == getattr(python, name).__name__
    if hotpath.IS_COMPILED:
        assert _probe(None) == "True proxy.hotpath._hotpath"
