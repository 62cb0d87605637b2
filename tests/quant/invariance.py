"""The batch- and thread-invariance check the quantized kernels' tests share."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

#: row ranges of a 70-row call the prompt-row kernels' tests take alone (tile edges: 16 and 32 rows)
PROMPT_ROWS = (slice(0, 1), slice(3, 8), slice(0, 16), slice(5, 22), slice(30, 70), slice(1, 33))


def assert_rows_and_threads_invariant(mm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                                      y: torch.Tensor, rows: Iterable[slice]) -> None:
    """``mm(x[r])`` (a contiguous copy) is the same bits as ``y[r]`` for every slice ``r`` of
    ``rows``, and ``mm(x)`` with one torch intra-op thread the same bits as ``y`` (``y = mm(x)`` with
    the process's count, which is restored): a row's result depends on neither the other rows of the
    call nor the thread count."""
    for r in rows:
        assert torch.equal(mm(x[r].contiguous()), y[r]), r
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(mm(x), y)
    finally:
        torch.set_num_threads(threads)
