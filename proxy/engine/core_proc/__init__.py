"""The engine core in a child process (vLLM v1's ``EngineCoreProc`` / ``MPClient`` split).

:class:`EngineProcClient` is an :class:`~proxy.engine.client.EngineCoreClient`: the child process
runs ``EngineCore`` (schedule, forward, sample) and nothing else; detokenization, stop strings,
framing and metrics stay in the API process (``AsyncEngineClient``'s output processor, the same as
with the in-process thread). The event loop, the SSE work and the engine's Python code then no
longer share one interpreter lock.

Transport: one duplex :func:`multiprocessing.Pipe` (``multiprocessing.connection``, pickle framing).
Why: it is the standard library (no new dependency), it is what ``multiprocessing`` itself uses for
the "spawn" start method that CUDA needs, and the traffic is small: one message per added or aborted
request, and one per engine step carrying that step's ``RequestOutput`` list (a few dozen small
dataclasses) plus its counters (``messages.StepResult``). pickle round-trips our dataclasses
(the messages, ``SamplingParams``, ``RequestOutput``) exactly, so there is no second schema to
keep in step (msgspec would need one; pyzmq's multi-peer sockets buy nothing with one peer).

Recovery when the child dies (SIGKILL, the OOM killer, a crash in native code): the reader thread sees
the pipe close; on the event loop every open request gets a final ``finish_reason="error"`` output
(the streams end with an error event and ``[DONE]`` at once), ``is_healthy`` turns False (``/health``
503, new requests 503), and a new child is started (log line; ``num_engine_restarts`` in the stats,
exported as ``streamproxy:engine_restarts_total``). When it is ready the server serves again. If the
new child fails to load, the engine stays dead (``/health`` 503) and the log says why. Once shutdown
has begun (``begin_drain``, then ``shutdown``) a dead child is never restarted, and ``shutdown`` kills
a child that is still loading.

Modules:

- ``messages``: what crosses the pipe, one dataclass a kind (commands, ``ReadyInfo``, ``StepResult``
  with its ``CoreStats``); the engine thread's commands are the same ones.
- ``entry``: the engine process's entry point (imports nothing heavy: the load, its imports
  included, may run at a lower priority than the serving thread); its signal handling.
- ``child``: the engine process's side (load, report ready, run the ``CoreDriver`` loop of
  ``proxy.engine.driver`` on the pipe, answer grammar compiles); its OpenMP wait policy and load
  priority.
- ``lifecycle``: starting the child and waiting for it to be ready, stopping it, killing it at exit.
- ``grammar``: the API process's half of grammar compiles (``ChildGrammarCompiler``, the pending
  compiles).
- ``proc_client``: ``EngineProcClient``, the API process's side (reader thread, restarts, counters,
  admission).

Import the names from their modules: this package imports none of them, so that the engine thread
(``proxy.engine.async_engine``, through ``proxy.engine.driver``) can use ``messages`` without loading
the process client.
"""
