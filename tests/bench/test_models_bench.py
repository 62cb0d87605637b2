"""bench/models_bench.py: the same-positions figures (exact values), the reference a stream's largest
gap during a load is read against (issue 48)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _load_module() -> Any:
    sys.path.insert(0, str(REPO / "bench"))  # models_bench imports rss_bench as a sibling
    try:
        spec = importlib.util.spec_from_file_location("models_bench", REPO / "bench" / "models_bench.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(REPO / "bench"))


mb = _load_module()


def test_pace_at_positions_reads_the_control_over_the_loads_positions() -> None:
    # a stream that slows as its context grows: gaps 10 ms for 4 chunks, then 20 ms, one of 30 ms
    gaps = [0.010] * 4 + [0.020, 0.020, 0.030, 0.020, 0.020]
    arrivals = [0.0]
    for g in gaps:
        arrivals.append(arrivals[-1] + g)
    # the load's gaps were gaps 4..8 (its largest 36 ms): read against 20 ms, not the first chunks' 10
    out = mb.pace_at_positions(arrivals, 4, 9, 0.036)
    assert out == {"tpot_same_positions_ms": 20.0, "max_gap_same_positions_ms": 30.0,
                   "max_gap_ratio_same_positions": 1.8, "control_max_ratio_same_positions": 1.5}


def test_pace_at_positions_is_empty_without_those_gaps() -> None:
    assert mb.pace_at_positions([0.0, 0.01, 0.02], 5, 9, 0.03) == {}
