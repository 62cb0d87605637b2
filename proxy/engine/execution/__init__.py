"""The engine's model-execution side: what runs a step's forward pass, and on which kernels.

The scheduler side (``proxy.engine``'s request, scheduler/, block manager, core, driver, client/,
core_proc/) decides which tokens of which requests a step computes; this package computes them. The
seam is the engine core (``proxy.engine.core``): it hands
:class:`~proxy.engine.execution.model_runner.ModelRunner`
a ``SchedulerOutput`` and gets logits back, then samples them (``sampler``); from the runner it reads
the KV pool's size and its ``PrefillPlan``, which it hands to the scheduler and the block manager.

- ``choice``: what runs, chosen once before the model loads (``choose_execution``); ``plan``: what
  the built engine runs and why not the rest (the log line, ``/server_info``; ``docs/execution.md``).
- ``model_runner``: one forward a step, through a ``decode_runner`` (eager, CUDA graphs or the CPU's
  compiled step); ``step_inputs``: a step's rows -> flat model inputs and attention metadata.
- ``compiled_step`` + ``traced_decode``: the CPU's ahead-of-time compiled decode step;
  ``decode_graphs`` + ``graph_kinds``: captured CUDA graphs; ``runtime_key``: what their saved
  artifacts (and the self-check's record) are keyed by.
- ``attention/``: the paged attention registered with transformers, its metadata, pools and kernels.
- ``sampler``: batched sampling; ``cpu_threads``: torch's intra-op threads per step.
"""
