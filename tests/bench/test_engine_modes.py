"""bench/engine_modes.py fails loudly: a mode whose model does not load ends the run with exit status
1 and the reason on stderr, instead of waiting out the load timeout or printing a half table."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_module() -> Any:
    spec = importlib.util.spec_from_file_location("engine_modes", REPO / "bench" / "engine_modes.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["engine_modes"] = module
    spec.loader.exec_module(module)
    return module


def test_a_mode_that_cannot_load_fails_the_run_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    engine_modes = _load_module()
    start = time.monotonic()
    code = engine_modes.main(["--model", str(tmp_path / "missing"), "--shapes", "4x4", "--concurrency", "1",
                              "--threads", "1", "--result-dir", str(tmp_path / "out"),
                              "--load-timeout", "300"])
    elapsed = time.monotonic() - start
    captured = capsys.readouterr()
    assert code == 1
    assert "engine_modes: FAILED in mode thread" in captured.err
    assert "not a Hugging Face folder or a .gguf file" in captured.err  # the one-line reason
    assert "engine modes," not in captured.out  # no table
    assert elapsed < 120  # not the load timeout
