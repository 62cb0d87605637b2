"""The admission rule both engine core clients apply in ``add_request`` (the HTTP 429).

Requests that will start at the next step (free places in the running batch) are not "waiting": a
burst into an idle server is admitted whole, up to ``max_num_seqs + max_waiting``. Past that,
``RateLimitError`` (429, vLLM's queue-full answer) instead of an unbounded queue.
"""

from __future__ import annotations

from proxy.errors import RateLimitError


def num_waiting(core_waiting: int, num_adds_sent: int, num_adds_taken: int) -> int:
    """Requests waiting: those in the core plus those sent to it and not taken yet.

    Read ``core_waiting`` before ``num_adds_taken``: the core's loop counts an add as taken before
    it queues it, so a request is then never counted twice (which would refuse one that fits).
    """
    return core_waiting + max(0, num_adds_sent - num_adds_taken)


def check_admission(num_running: int, num_waiting: int, max_num_seqs: int, max_waiting: int) -> None:
    """Admit one more request, or refuse it.

    Raises:
        RateLimitError: more than ``max_waiting`` requests would wait beyond the running batch's free
            places (``max_num_seqs - num_running``).
    """
    free_slots = max(0, max_num_seqs - num_running)
    if num_waiting - free_slots >= max_waiting:
        raise RateLimitError(f"too many requests waiting ({max_waiting}); retry later")
