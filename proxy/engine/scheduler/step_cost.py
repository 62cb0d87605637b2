""":class:`StepCostModel`: measured step times, and how many prefill tokens a step with decodes takes.

Every running stream waits for the whole step, so a prefill chunk joining a step of decodes
lengthens every stream's inter-token gap by its cost, and that cost depends on the device (on a
CPU a prompt token costs a good share of a decode step, on a GPU hundreds are nearly free). The
model measures instead of assuming:

- every step's time ``t`` is fitted as ``a + b * n + c * p + e * [p > 0]`` for its ``n`` decodes and
  ``p`` prefill tokens (least squares, older steps forgotten geometrically): ``D(n) = a + b * n`` is
  the decode-only step, ``c`` a prefill token, ``e`` the fixed cost of a step with any prefill
  (where prompt tokens run in fixed-shape calls, ``proxy.quant.dense_prefill``). Only decode-only
  steps tell ``e`` apart from ``a``; a prior (``FIXED_COST_RIDGE``) keeps ``e`` near 0 until they do.
- a step with ``n`` decodes and ``w`` requests waiting takes at most
  ``p = ((ratio - 1) * D(n) * (1 + w / n) - e) / c`` prefill tokens, at least ``min_tokens``, in
  multiples of ``multiple``: with no queue the step lasts about ``ratio`` decode-only steps, and the
  room grows with the users waiting for a first token per stream it spares a long gap.
- no limit while long gaps are rare: while the decodes of steps that ran over ``ratio`` decode
  steps stay within ``long_gap_fraction`` of all decodes counted (forgotten geometrically), a step
  may be long (a percentile of gaps is what a streaming user sees);
- no limit either with ``ratio`` 0 (off) or before the fit is defined (the first steps of a run).

The token knobs and the burst rule that lifts this bound are the scheduler's (``SchedulerConfig``,
``StepBudget.for_step``); ``docs/scheduling.md`` has the measurements and what was tried.
Pure Python (a 4 x 4 solve a step), no torch, as the scheduler package requires.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from proxy.settings import check_prefill_bound

if TYPE_CHECKING:
    from proxy.engine.scheduler.config import SchedulerConfig

_NUM_TERMS = 4
"""Regressors of the fit: a step, a decode, a prefill token, any prefill."""
_FIXED = 3
"""Index of the last regressor, any prefill (its coefficient is the fixed cost ``e``)."""


class StepCostModel:
    """A step-time model fitted to measured steps, and the prefill-token limit it gives.

    The model is ``t = a + b * num_decodes + c * num_prefill_tokens + e * [num_prefill_tokens > 0]``
    (seconds), fitted by least squares with exponential forgetting (older steps weigh
    ``forgetting ** age``) and a small ridge that keeps it defined before the steps vary enough.
    Under load nearly every step carries some prefill, so decode-only steps of each batch size are
    rare: the joint fit uses them all. The scheduler builds its model with :meth:`from_config`.

    Args:
        max_ratio: the longest a step with decodes may take with no request waiting, in
            decode-only steps of the same batch (> 1; waiting requests widen it,
            :meth:`prefill_token_limit`); 0: no limit from measurements (always None).
        min_tokens: the smallest limit given (a prefill always moves on).
        multiple: limits are rounded down to a multiple of this many tokens, at least one multiple:
            where the model computes prompt tokens in calls of a fixed number of rows
            (``proxy.quant.dense_prefill``), a smaller chunk costs a whole call.
        long_gap_fraction: the limit is lifted while the decodes of steps that ran over
            ``max_ratio`` decode steps (long inter-token gaps), counting this one's, stay within this
            share of all decodes counted (``Settings.max_long_gap_fraction``); 0: never.
        gap_forgetting: weight kept by the earlier steps' gap counts at each new step.
        forgetting: weight kept by the earlier steps at each new one (0 < forgetting <= 1).
        min_steps: steps observed before a limit is given.

    Raises:
        ValueError: ``max_ratio`` or ``long_gap_fraction`` out of range
            (:func:`proxy.settings.check_prefill_bound`), ``min_tokens`` or ``multiple`` < 1,
            ``forgetting`` or ``gap_forgetting`` outside (0, 1].
    """

    #: ridge added to the normal equations' diagonal (seconds^0 units of a step's regressors)
    RIDGE = 1e-6
    #: further ridge on the fixed prefill cost ``e`` (added to its diagonal entry, the forgotten
    #: count of steps with prefill): ``e`` is told apart from ``a`` only by steps without prefill;
    #: where there are (nearly) none, as under steady load, the two columns are collinear and the
    #: split is arbitrary; this prior puts the step's cost in ``a`` until steps show ``e``.
    FIXED_COST_RIDGE = 0.5

    def __init__(self, max_ratio: float, min_tokens: int = 16, forgetting: float = 0.98,
                 min_steps: int = 8, multiple: int = 1, long_gap_fraction: float = 0.0,
                 gap_forgetting: float = 0.998) -> None:
        check_prefill_bound(max_ratio, long_gap_fraction)
        if min_tokens < 1 or multiple < 1 or not 0 < forgetting <= 1 or not 0 < gap_forgetting <= 1:
            raise ValueError("min_tokens and multiple must be >= 1, forgetting and gap_forgetting in (0, 1]")
        self.max_ratio = max_ratio
        self.min_tokens = min_tokens
        self.multiple = multiple
        self.forgetting = forgetting
        self.min_steps = min_steps
        self.long_gap_fraction = long_gap_fraction
        self.gap_forgetting = gap_forgetting
        self.num_steps = 0
        self._gaps = 0.0
        self._long_gaps = 0.0
        # sums of w * x x^T and w * x * t, x = (1, decodes, prefill tokens, any prefill)
        self._xx = [[0.0] * _NUM_TERMS for _ in range(_NUM_TERMS)]
        self._xt = [0.0] * _NUM_TERMS
        self._fit: tuple[float, float, float, float] | None = None

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> StepCostModel:
        """The model of ``config``'s measured bound: its ratio, long-gap fraction and token multiple."""
        return cls(config.max_prefill_step_ratio, multiple=config.prefill_token_multiple,
                   long_gap_fraction=config.max_long_gap_fraction)

    def observe(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        """Record one step: ``num_decodes`` one-token entries, ``num_prefill_tokens`` prefill tokens,
        ``seconds`` of forward pass and sampling."""
        if seconds <= 0 or num_decodes + num_prefill_tokens == 0:
            return
        if num_decodes:  # its decodes' inter-token gaps; long ones where prefill made it over the ratio
            long = False
            if num_prefill_tokens and self.max_ratio > 0:
                base = self.decode_step_estimate(num_decodes)
                long = base is not None and seconds > self.max_ratio * base
            g = self.gap_forgetting
            self._gaps = g * self._gaps + num_decodes
            self._long_gaps = g * self._long_gaps + (num_decodes if long else 0)
        x = (1.0, float(num_decodes), float(num_prefill_tokens), float(num_prefill_tokens > 0))
        f = self.forgetting
        for i in range(_NUM_TERMS):
            self._xt[i] = f * self._xt[i] + x[i] * seconds
            for j in range(_NUM_TERMS):
                self._xx[i][j] = f * self._xx[i][j] + x[i] * x[j]
        self.num_steps += 1
        self._fit = None

    def coefficients(self) -> tuple[float, float, float, float] | None:
        """``(a, b, c, e)``: seconds a step, a decode, a prefill token and a step's having any
        prefill add; None before ``min_steps`` steps with both decodes and prefill tokens among them."""
        # sums of w * decodes^2 and w * tokens^2: zero until a step with decodes / prefill tokens
        if self.num_steps < self.min_steps or self._xx[1][1] == 0 or self._xx[2][2] == 0:
            return None
        if self._fit is None:
            n = _NUM_TERMS
            m = [row[:] + [self._xt[i]] for i, row in enumerate(self._xx)]
            for i in range(n):
                m[i][i] += self.RIDGE * (1.0 + m[i][i])
            m[_FIXED][_FIXED] += self.FIXED_COST_RIDGE
            for col in range(n):  # Gauss-Jordan with partial pivoting on the n x (n + 1) system
                pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
                m[col], m[pivot] = m[pivot], m[col]
                if m[col][col] == 0.0:
                    return None
                for r in range(n):
                    if r != col:
                        k = m[r][col] / m[col][col]
                        m[r] = [a - k * b for a, b in zip(m[r], m[col], strict=True)]
            a, b, c, e = (m[i][n] / m[i][i] for i in range(n))
            self._fit = (a, b, c, e)
        return self._fit

    def decode_step_estimate(self, num_decodes: int) -> float | None:
        """``D(n) = a + b * n`` seconds, the fitted decode-only step of ``n`` decodes."""
        fit = self.coefficients()
        return None if fit is None else fit[0] + fit[1] * num_decodes

    def prefill_token_limit(self, num_decodes: int, num_waiting: int = 0) -> int | None:
        """Most prefill tokens a step with ``n = num_decodes`` decodes should take,
        ``((max_ratio - 1) * D(n) * (1 + w / n) - e) / c`` for ``w = num_waiting``, at least
        ``min_tokens``; None: no limit (off, no decodes, long gaps rare enough to allow this step's,
        not yet fitted, or a fit without a positive step or token cost).

        ``num_waiting``: requests in the waiting queue (new or preempted, the one being admitted
        included), as the scheduler passes ``len(waiting)``. The bound spares ``n`` streams
        a longer gap at the cost of ``w`` users' first tokens, so the room it leaves grows with
        ``w / n``; in a burst the scheduler does not ask."""
        if self.max_ratio <= 0 or num_decodes == 0:
            return None
        q = self.long_gap_fraction
        if q > 0 and self._long_gaps + num_decodes <= q * (self._gaps + num_decodes):
            return None
        fit, base = self.coefficients(), self.decode_step_estimate(num_decodes)
        if fit is None or base is None:
            return None
        _, _, per_token, fixed = fit
        if base <= 0 or per_token <= 0:
            return None
        extra = (self.max_ratio - 1) * base * (1 + num_waiting / num_decodes)
        limit = max(self.min_tokens, int((extra - max(fixed, 0.0)) / per_token))
        return max(self.multiple, limit - limit % self.multiple)
