"""Continuous-batching scheduler: which requests run each step, and how many tokens each (no torch).

Policy (vLLM v1's unified scheduler, simplified). What each knob does is :class:`SchedulerConfig`'s
docstring; the measurements behind the defaults and what was tried are in ``docs/scheduling.md``.

- Every step has a token budget, ``max_num_batched_tokens``. :meth:`Scheduler.schedule` fills it in
  vLLM's order: the running decodes (one token each), then the running requests mid-prefill, then
  waiting requests FCFS, each taking ``min(tokens to compute, budget left)``. So a long prompt is
  prefilled in chunks and never stalls the decodes of others (chunked prefill, Agrawal et al.
  2023, "Sarathi").
- Every running stream waits for the whole step, so prefill joining a step with decodes is bounded
  (:class:`StepBudget`): each prompt adds at most ``long_prefill_token_threshold`` tokens, at most
  ``max_num_partial_prefills`` prompts join, and with ``max_prefill_step_ratio`` > 0 all its prefill
  tokens together keep the step within that many decode-only steps by a fit to measured step times
  (:class:`StepCostModel`; lifted while long gaps are rare, ``max_long_gap_fraction``). The bound
  trades time to first token for steady inter-token gaps. A step without decodes takes prompts up
  to the whole budget. The vision encoder's work on a prompt's images counts as prefill cost of the
  steps that encode them, piece by piece (``images``; vLLM's encoder budget per multimodal item).
- A burst of arrivals (with the measured bound on, more waiting requests could start than there are
  decodes) is admitted as a step without decodes: its prompts take the whole token budget, neither
  the measured bound nor the token knobs apply.
- Every step caps its prefill query rows, each chunk padded to the longest, at twice the token
  budget (``StepBudget.for_step``).
- Prefix caching (``BlockManager``): a waiting request starts after its longest cached prefix of full
  blocks (at least its last token is computed, its logits are needed); the blocks its step fills
  join the cache once the step is scheduled, and are dropped again if the step fails.
- At most ``max_num_seqs`` requests run at once; while any run, a waiting one is admitted only if it
  leaves ``watermark`` of the KV pool free.
- When the KV pool cannot hold a running request's next tokens, the most recently admitted running
  request is preempted by recompute: its blocks are freed, ``num_computed_tokens`` reset to 0 and it
  goes back to the front of the waiting queue (its generated tokens are kept and re-prefilled).
  No new request is admitted in a step that preempted.
- A request finishes with "stop" on EOS (unless ``ignore_eos``) or a ``stop_token_ids`` token, once
  ``min_tokens`` are out; with "length" at ``max_tokens`` or when prompt + output reach
  ``max_model_len`` (or the whole KV pool). Stop strings are the API layer's job (it aborts).

Modules: ``config`` (:class:`SchedulerConfig`: the knobs), ``queues`` (the waiting queue, the running
batch, and aborts, failures and preemption), ``scheduler`` (:class:`Scheduler`: ``schedule`` and
``update``), ``images`` (the vision encoder's cost in a step's budget), ``budget``
(:class:`StepBudget`: a step's token budget and the prefill bound, from a :class:`StepState` of the
queues), ``step_cost`` (:class:`StepCostModel`: the measured bound), ``finish`` (:func:`check_stop`:
the finish rule of a sampled token), ``output`` (:class:`SchedulerOutput`: one step's work for the
model runner). Import the names from this package.
"""

from __future__ import annotations

from proxy.engine.scheduler.budget import StepBudget, StepState
from proxy.engine.scheduler.config import SchedulerConfig
from proxy.engine.scheduler.finish import check_stop
from proxy.engine.scheduler.output import SchedulerOutput
from proxy.engine.scheduler.scheduler import Scheduler
from proxy.engine.scheduler.step_cost import StepCostModel

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerOutput", "StepBudget", "StepCostModel", "StepState",
           "check_stop"]
