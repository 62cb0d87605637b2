"""``bench/compare.py``'s ``--busy`` table: each ``NAME+busyN`` run against ``NAME``'s idle run."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import compare


def run(c: int, tok_s: float, tpot_ms: float) -> dict[str, float]:
    return {"max_concurrency": c, "output_throughput": tok_s, "mean_tpot_ms": tpot_ms}


def test_busy_table_shares_of_idle() -> None:
    summaries = {
        "streamproxy": {"runs": [run(1, 16.0, 60.0), run(16, 100.0, 140.0)]},
        "streamproxy+busy1": {"runs": [run(1, 8.0, 120.0), run(16, 25.0, 560.0)]},
        "llama-server+busy2": {"runs": [run(1, 5.0, 10.0)]},  # no idle run of its own: left out
    }
    table = compare.busy_table(summaries).splitlines()
    assert table[2:] == [
        "| 1 | streamproxy | 1 | 8.0 | 0.50x | 120.0 | 0.50x |",
        "| 16 | streamproxy | 1 | 25.0 | 0.25x | 560.0 | 0.25x |",
    ]
    assert compare.busy_table({"streamproxy": summaries["streamproxy"]}) == ""
