"""Build the Cython hot path (``ext/*.pyx``) into the ``proxy.hotpath`` package, and the CPU
matmul kernels (``ext/kernels/*.pyx``) into ``proxy.quant``.

Each ``ext/NAME.pyx`` becomes the extension module ``proxy.hotpath._NAME``; the pure-Python
twins in ``proxy/hotpath/`` select it at import time (see ``proxy/hotpath/__init__.py``).
Each ``ext/kernels/NAME.pyx`` becomes ``proxy.quant._NAME``, built with OpenMP; it is optional (a
compiler without OpenMP skips it with a warning) and its Python module falls back to torch ops.
``ext/kernels/torch_ops.cpp`` becomes ``proxy.quant._torch_ops`` where torch is importable at build
time (optional too).
"""

from pathlib import Path

from setuptools import Extension, setup

try:
    from Cython.Build import cythonize
except ImportError as exc:  # pragma: no cover - build-system requires Cython
    raise SystemExit("Cython is required to build streamproxy (pip install Cython)") from exc

#: the kernels' flags after Python's own (``sysconfig``'s CFLAGS come first): Python builds with
#: ``-fwrapv`` (signed overflow wraps), which made the int4 kernel's loops 13-15% slower
#: (docs/bench/2026-12-07-decode-overheads.md); the kernels never overflow a signed integer.
KERNEL_FLAGS = ["-fno-wrapv"]

sources = sorted(Path("ext").glob("*.pyx"))
extensions = [
    Extension(f"proxy.hotpath._{src.stem}", [str(src)], extra_compile_args=["-O3"]) for src in sources
]
extensions += [
    Extension(
        f"proxy.quant._{src.stem}",
        [str(src)],
        depends=sorted(str(p) for p in Path("ext/kernels").glob("*.h")),  # headers include headers
        include_dirs=["ext/kernels"],
        extra_compile_args=["-O3", "-fopenmp", *KERNEL_FLAGS],
        extra_link_args=["-fopenmp"],
        optional=True,
    )
    for src in sorted(Path("ext/kernels").glob("*.pyx"))
]


def torch_ops_extension() -> Extension | None:
    """``ext/kernels/torch_ops.cpp`` as ``proxy.quant._torch_ops``: the C++ kernels of this project's
    torch ops, compiled against the torch installed beside the build (the Makefile installs without
    build isolation for it). None, with a note, where torch is not importable at build time (an
    isolated build): the ops then keep their Python kernels."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        print("note: torch is not importable at build time; proxy.quant._torch_ops is not built "
              "(the ops keep their Python kernels)")
        return None
    return Extension(
        "proxy.quant._torch_ops",
        ["ext/kernels/torch_ops.cpp"],
        # rebuilt when a kernel header changes
        depends=sorted(str(p) for p in Path("ext/kernels").glob("*.h")),
        include_dirs=["ext/kernels", *cpp_extension.include_paths()],
        library_dirs=cpp_extension.library_paths(),
        libraries=["c10", "torch_cpu"],
        extra_compile_args=["-O3", "-fopenmp", "-std=c++20", *KERNEL_FLAGS,
                            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"],
        extra_link_args=["-fopenmp"],
        language="c++",
        optional=True,
    )


torch_ops = torch_ops_extension()
if torch_ops is not None:
    extensions.append(torch_ops)

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
        },
    ),
)
