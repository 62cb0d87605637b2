"""Continuous-batching scheduler: which requests run each step, and how many tokens each (no torch).

Policy (vLLM v1's unified scheduler, simplified):

- Every step has a token budget ``max_num_batched_tokens``. Running requests that need exactly one
  token (decode) are scheduled first, then running requests in the middle of a chunked prefill,
  then waiting requests FCFS, each taking ``min(remaining tokens, budget left)`` tokens. So a long
  prompt is prefilled in chunks and never stalls the decodes of others (chunked prefill, Agrawal et
  al. 2023, "Sarathi").
- Prefill work joining a step that carries decodes is bounded further: each prompt adds at most
  ``long_prefill_token_threshold`` tokens (vLLM's knob; 0 = no cap) and at most
  ``max_num_partial_prefills`` prompts join (vLLM's name for concurrent partial prefills). A step's
  time grows with its tokens, and every running stream waits for the whole step, so each prefill
  token in a decode step lengthens every stream's inter-token gap; bounding them keeps p99 ITL near
  the decode step time. The price is time to first token when many prompts arrive together: they are
  prefilled one small chunk per step instead of all at once (with the measured bound off; with it
  on, a burst is admitted whole, below). A step without decodes (nothing is streaming yet) takes
  prompts up to the full budget. Sarathi-Serve (Agrawal et al. 2024) makes the same trade with a
  per-step token budget. The server's defaults (``Settings``: 128 tokens, 2 prompts) cap a decode
  step's prefill at 256 tokens (half the step budget of 512 then); on the shared 2-core CPU
  (SmolLM2-135M bf16, 8 streams, 128 in / 64 out, three servers side by side) they gave p99 ITL /
  mean TPOT 1.70 against 1.64 unbounded and 2.09 for 64 tokens / 1 prompt, whose p99 TTFT was 2.6x
  the unbounded one: per-step overhead dominates there, so small chunks cost more time to first
  token than they save in inter-token gaps. On top of the token knobs, the prefill tokens of a
  decode step are held to what keeps it within ``max_prefill_step_ratio`` decode-only steps by a
  model fitted to measured step times (``step_cost``; device-independent), widened by
  ``1 + waiting / decoding`` requests, and lifted while the steps that ran over the ratio gave at
  most ``max_long_gap_fraction`` of the recent inter-token gaps (an occasional prompt joins at once:
  a percentile of gaps is what streaming users see). Idle 2-core CPU, default model, 128 in / 64
  out, beside llama-server: 8 streams p99 ITL / mean TPOT 1.38 (97 / 70 ms), p99 TTFT 3.8 s (llama-
  server 4.0 s); 16 streams 2.47 (303 / 123 ms), 7.6 s (7.7 s), before the burst rule below
  (``step_cost`` has its figures).
- A burst of arrivals (with the measured bound on, more waiting requests than decoding ones, of
  those ``max_num_seqs`` leaves room for) is admitted as in a step without decodes: its prompts take
  the step's whole token budget, and neither the measured bound nor the token knobs apply (every
  step caps its prefill rows as padded to the longest chunk at twice the budget, ``budget``).
  Bounding it would hold many users' first tokens back to spare a few streams' gaps, and chunks of
  the knobs' size gave every running stream a long gap at each step of the burst (a step with a
  prompt chunk is long whatever the chunk), where a step of the whole budget gives each one. With
  vLLM's OpenAI-server budget of 2048 tokens (``Settings``), the burst into an idle engine of a
  benchmark's (or a batch job's) first wave is prefilled in one or two steps and its first tokens
  come together, as llama-server's batched prompts do; its streams then decode in step. Measured,
  2-core AVX2 CPU, default model (dense fp32), 128 in / 64 out, closed loop, ``bench/compare.py``:
  the bursts bounded by the knobs and a 512-token budget made p99 TTFT 9.9 / 20.2 s at 8 / 16
  streams (llama-server 9.2 / 18.4 s in that run); the whole budget of 2048 tokens, in one run with
  llama-server: 8 streams p99 TTFT 4.9 s (llama-server 8.4 s), p99 ITL / mean TPOT 1.12, 36.0 tok/s
  (37.7); 16 streams 9.8 s (18.1 s), 1.90, 41.6 tok/s (35.0).
  With ``max_prefill_step_ratio`` 0 (vLLM's policy) the knobs hold in every step with decodes.
- Prefix caching (``BlockManager``): a waiting request starts after its longest cached prefix of full
  blocks (at least its last token is computed, its logits are needed); the blocks its step fills
  join the cache once the step is scheduled, and are dropped again if the step fails.
- At most ``max_num_seqs`` requests run at once.
- When the KV pool cannot hold a running request's next tokens, the most recently admitted running
  request is preempted by recompute: its blocks are freed, ``num_computed_tokens`` reset to 0 and it
  goes back to the front of the waiting queue (its generated tokens are kept and re-prefilled).
  No new request is admitted in a step that preempted.
- A request finishes with "stop" on EOS (unless ``ignore_eos``) or a ``stop_token_ids`` token, once
  ``min_tokens`` are out; with "length" at ``max_tokens`` or when prompt + output reach
  ``max_model_len`` (or the whole KV pool). Stop strings are the API layer's job (it aborts).

Modules: ``scheduler`` (:class:`Scheduler`: the queues, ``schedule`` and ``update``), ``budget``
(:class:`StepBudget`: a step's token budget and the prefill bound above), ``finish``
(:func:`check_stop`: the finish rule of a sampled token), ``output`` (:class:`SchedulerOutput`: one
step's work for the model runner). Import the names from this package.
"""

from __future__ import annotations

from proxy.engine.scheduler.budget import StepBudget
from proxy.engine.scheduler.finish import check_stop
from proxy.engine.scheduler.output import SchedulerOutput
from proxy.engine.scheduler.scheduler import Scheduler
from proxy.engine.scheduler.step_cost import StepCostModel

__all__ = ["Scheduler", "SchedulerOutput", "StepBudget", "StepCostModel", "check_stop"]
