""":class:`StepCostModel`: measured step times, and how many prefill tokens a decode step can take.

Every streaming request waits for the whole step, so a prefill chunk that joins a step of running
decodes lengthens every stream's inter-token gap by its cost. What a prefill token costs next to a
decode step depends on the device: measured on a 2-core CPU (SmolLM2-135M, int4 weights), a
decode step of 8 sequences took 47 ms and each prefill token ~1.7 ms more (a 128-token chunk made
the step 5.6x longer); on a GPU prefill tokens are nearly free up to hundreds. A fixed token cap
cannot suit both, so the scheduler measures instead:

- every step's time ``t`` is fitted as ``a + b * n + c * p + e * [p > 0]`` for its ``n`` decodes
  and ``p`` prefill tokens (least squares, older steps forgotten geometrically), which gives the
  decode-only step ``D(n) = a + b * n``, the cost ``c`` of one prefill token and the fixed cost
  ``e`` of a step that carries any prefill;
- a step with ``n`` decodes then takes at most ``p = ((ratio - 1) * D(n) * (1 + w / n) - e) / c``
  prefill tokens for ``w`` requests waiting, at least ``min_tokens``, so that with no queue it
  lasts about ``ratio`` times a decode-only step (a queue widens it, below).
- The fixed cost matters where prompt tokens run in calls of a fixed shape
  (``proxy.quant.dense_prefill``: 64 rows through dense weights, ~34 ms a step for the default
  model on a 2-core CPU whether the chunk has 1 or 64 tokens): a fit linear in ``p`` alone charged
  it to the tokens of 64-token chunks, so a 16-token chunk was priced at a quarter of its cost and
  the steps ran 3-5x a decode step (8 streams, p99 ITL 2.6x the mean TPOT). Only decode-only
  steps tell ``e`` apart from ``a``; a prior (``FIXED_COST_RIDGE``) keeps ``e`` near 0 until they do:
  under steady load the split was arbitrary and once gave ``D(11)`` 155 ms where a decode-only step
  took 200 ms (skinny fp32 linears, 2-core AVX2 CPU), so the limit sat at its floor and prompts of a
  16-stream burst were admitted 3.3 s apart instead of ~1 s.
- In a burst of arrivals (more requests waiting than decoding) the scheduler asks for no limit: it
  admits the burst's prompts up to the step's token budget (the scheduler package docstring has
  the rule and its figures).
- Below a burst, the room grows with the queue: ``(max_ratio - 1) * D(n)`` is scaled by
  ``1 + w / n`` for ``w`` requests waiting. With the ratio alone the prefill share of time is capped
  near ``(ratio - 1) / ratio`` less the fixed cost; once decode steps got faster (skinny fp32
  linears) that fell below what 16 closed-loop streams of 128-token prompts need, and the queue grew:
  measured, 2-core AVX2 CPU, 128 in / 64 out, ``bench/compare.py``, streamproxy alone, runs one
  after another (ratio alone / scaled): 8 streams 21.0 / 27.5 tok/s, p99 TTFT 13.8 / 9.2 s, p99 ITL
  / mean TPOT 2.24 / 1.57; 16 streams 24.4 / 33.8 tok/s, 34.2 / 14.6 s, 1.98 / 1.71. (Tried the same
  day, and not kept: ratio 3, which left 8 streams at p99 ITL 2.60x the TPOT; the ratio taken
  against the mean recent gap instead of ``D(n)``: 2.95x; the burst rule at ``2 w > n``: 16 streams
  3.0x with 28 s p99 TTFT.)
- The bound is also lifted while long gaps are rare: a step with ``n`` decodes that runs over
  ``ratio`` decode steps gives its ``n`` streams a long inter-token gap; while such gaps stay within
  ``long_gap_fraction`` of all recent ones (counted over steps with forgetting), a step may be long.
  A percentile, not every step, is what a streaming user sees (p99 ITL): an occasional prompt (a
  chat's next turn beside another stream's decode) is then prefilled at once instead of in
  floor-sized chunks that each wait for a decode step. Measured (2-core AVX2 CPU, dense fp32, 59
  new tokens of a 1183-token conversation beside one decoding stream): TTFT 1124 -> 677 ms at 0.005.
  Multi-turn chat (``bench/compare.py --dataset multiturn``, 2 conversations with system prompts
  of their own, 6 turns), runs one after another on that machine: turns 2-6 mean TTFT 1755 ms at 0,
  1348 and 1403 ms at 0.01, p99 ITL 405 / 326 / 335 ms (fewer chunked steps); 128 in / 64 out at 8
  and 16 streams: no step with several long gaps beyond the initial burst's.
- A first version kept a moving average of decode-only steps per ``n`` and charged a mixed step's
  excess over it to its prefill tokens. Under load decode-only steps are rare, so ``D(n)`` came
  from another batch size, the token cost was overestimated, the limit fell to its floor and the
  queue backed up (8 streams: p99 TTFT 2.5 -> 10 s). The joint fit does not need them.

The ratio is ``Settings.max_prefill_step_ratio``; vLLM's token knobs
(``long_prefill_token_threshold``, ``max_num_partial_prefills``, ``max_num_batched_tokens``) still
bound the step on top (outside a burst, where only the token budget does). Until both costs are
measured (the first steps of a run) only the token knobs apply. The bound trades time to first token
for steady inter-token gaps (the package docstring has the figures).
Pure Python (a 4 x 4 solve a step), no torch, as the scheduler package requires.
"""

from __future__ import annotations

from proxy.settings import check_prefill_bound

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
    rare: the joint fit uses them all.

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
    #: split was arbitrary (measured: ``e`` 157 ms and ``a`` 100 ms, so ``D(11)`` 155 ms where a
    #: decode-only step of 11 took 200 ms, and the limit sat at its floor); this prior puts the
    #: step's cost in ``a`` until steps show ``e``.
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
        ``w / n`` (module docstring: measured); while they outnumber the decodes (a burst) the
        scheduler does not ask."""
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
