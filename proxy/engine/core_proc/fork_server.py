"""What the fork server that starts engine processes imports before its first fork
(``proxy.engine.core_proc.lifecycle``: multiprocessing's "forkserver" preload). Imported by that
process only: importing it sets SIGTERM to be ignored there and runs :func:`preload`.

Why ignore SIGTERM: a signal to the whole process group (``kill -TERM -PGID``, a supervisor's
control group) reaches the fork server too; multiprocessing's fork server keeps SIGTERM's default
action and would die, and its death reads to the API process as the death of every engine process
it forked (their exit statuses travel through it), while the API process is draining those engines'
streams. It exits on its own when the API process does (the pipe multiprocessing keeps for that
closes). The engine processes it forks set their own handlers (``proxy.engine.core_proc.entry``).
"""

from __future__ import annotations

import contextlib
import importlib
import signal

import proxy.engine.core_proc.entry  # noqa: F401 - imported once here, not in every engine process

# what a load imports (``proxy.engine.loading.build_core``'s imports reach transformers' modeling
# code and xgrammar: ~2 s of the ~2.5 s alone), and the default model's architecture
PRELOAD_MODULES = ["transformers", "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
                   "gguf", "proxy.engine.core_proc.child", "proxy.engine.loading", "proxy.engine.core",
                   "proxy.engine.selfcheck_record", "proxy.engine.structured", "proxy.models.load",
                   # what loading the saved compiled decode step imports (load_compiled_function)
                   "torch._dynamo.aot_compile", "torch._functorch._aot_autograd.aot_autograd_result",
                   "torch._inductor.compile_fx", "torch._inductor.codecache", "torch._inductor.output_code"]


def preload() -> None:
    """Import here, once, what every engine process's load imports (torch, transformers, the engine,
    inductor's side of loading the compiled decode step), so that a child forked later starts its load
    at once: a load on a several-model server runs at idle priority beside the models serving, and
    these imports (~2 s of a core alone) took 35-40 s of its 45 there
    (``docs/bench/2026-12-06-load-reserve.md``). Inductor's probe of the vector instruction sets its
    C++ can use runs here too (``valid_vec_isa_list``: a library built and loaded in a child process
    per set, the answer cached for the process), as every child's first step load would
    (``docs/bench/2026-12-06-load-warm.md``).

    Only with a CPU build of torch (``torch.version.cuda`` and ``.hip`` None): there ``triton`` is
    marked absent first (``proxy.models.device.mark_triton_absent``, as for a CPU server). With a GPU
    build only torch itself is imported (importing it touches no device; whether triton stays out
    depends on each model's ``--device``, which the child decides). Nothing here runs a torch
    operation: a parallel region would start OpenMP's threads, which a fork does not copy."""
    import torch

    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        from proxy.models.device import mark_triton_absent

        mark_triton_absent()  # before transformers imports torch._dynamo
        for name in PRELOAD_MODULES:
            importlib.import_module(name)
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list

        # inductor's probe of the vector ISAs its C++ can use, cached for the process; where it fails,
        # a child's own load probes again and says what failed
        with contextlib.suppress(Exception):
            valid_vec_isa_list()


signal.signal(signal.SIGTERM, signal.SIG_IGN)
preload()
