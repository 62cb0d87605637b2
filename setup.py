"""Build the Cython hot path (``ext/*.pyx``) into the ``proxy.hotpath`` package, and the CPU
matmul kernels (``ext/kernels/*.pyx``) into ``proxy.quant``.

Each ``ext/NAME.pyx`` becomes the extension module ``proxy.hotpath._NAME``; the pure-Python
twins in ``proxy/hotpath/`` select it at import time (see ``proxy/hotpath/__init__.py``).
Each ``ext/kernels/NAME.pyx`` becomes ``proxy.quant._NAME``, built with OpenMP; it is optional (a
compiler without OpenMP skips it with a warning) and its Python module falls back to torch ops.
"""

from pathlib import Path

from setuptools import Extension, setup

try:
    from Cython.Build import cythonize
except ImportError as exc:  # pragma: no cover - build-system requires Cython
    raise SystemExit("Cython is required to build streamproxy (pip install Cython)") from exc

sources = sorted(Path("ext").glob("*.pyx"))
extensions = [
    Extension(f"proxy.hotpath._{src.stem}", [str(src)], extra_compile_args=["-O3"]) for src in sources
]
extensions += [
    Extension(
        f"proxy.quant._{src.stem}",
        [str(src)],
        include_dirs=["ext/kernels"],
        extra_compile_args=["-O3", "-fopenmp"],
        extra_link_args=["-fopenmp"],
        optional=True,
    )
    for src in sorted(Path("ext/kernels").glob("*.pyx"))
]

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
