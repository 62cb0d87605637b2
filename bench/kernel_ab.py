"""The linear kernels of ``ext/kernels`` (int4: AMX or its AVX2 variant; int8 g16) at a decode step's
shapes, a git revision's headers against the working tree's, interleaved in one process (steadier than
two servers on a shared machine).

Both versions are compiled from their headers (``gcc -O3 -fopenmp``, no ``-fwrapv``: as ``setup.py``
builds the kernels)
into two shared libraries called through ``ctypes`` on numpy arrays (no torch: one OpenMP runtime).
One pass is a whole decode step's linears of the chosen shape set (default SmolLM2-1.7B in Q4_K_M:
144 Q4_K layers as int4 g32, 24 Q6_K layers and the tied Q6_K lm_head as int8 g16, ~1.3 GB of
weights, so that every pass reads them from memory), random weights, at each row count. Per pass and
version the time of each layer kind is summed; printed are the medians over ``--repeat`` passes, the
machine's read bandwidth with 2 threads (the same bytes, summed with AVX2 loads) and whether the
two versions' outputs are the same bits (checked before timing, at 1, 3, 16 and 17 rows).

The int8 layers of a version take the AMX int8 kernel (``amx_int8.h``, bf16 activations, its scales
split where it takes them) where its headers have it and the CPU runs it, else the split group-16 scales
(``sp_q8_matmul_split``) where they have them, else the fp32 scales.

Usage: ``python bench/kernel_ab.py [--base HEAD] [--rows 1,16] [--repeat 7] [--threads 2]
[--kinds int4,int8] [--base-cflags '-DNAME=VALUE'] [--tree-cflags ...]`` (the flags tune a header's
macros, e.g. ``-DSP_Q8_PREFETCH=2048``, the prefetch distance of the int8 calls of 2-4 rows). Needs
gcc with AMX intrinsics and a CPU with AMX-BF16, or (headers from 35d7cd5 on, which have the int4
kernel's AVX2 variant) AVX2 and FMA; the int8 kernel runs its best instruction set (AVX-512 where present).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HEADERS = ("amx_int4.h", "avx2_int4.h", "q8_matmul.h", "amx_int8.h")
HARNESS = r"""
#include "amx_int4.h"
#include "q8_matmul.h"
#if __has_include("amx_int8.h")
#include "amx_int8.h"
int amx8(void) { return sp_amx_available(); }
void a8(const uint16_t *x, int64_t M, int64_t K, const int8_t *codes, const float *block, const int8_t *sub,
        int64_t N, float *y, int nt) {
    sp_amx_int8_matmul(x, M, K, codes, block, sub, 16, 1, N, y, nt);
}
#endif
#if __has_include("avx2_int4.h") /* the int4 kernel's AMX variant, else its AVX2 one */
int avail(void) { return sp_int4_isa() != 0; }
#define SP_INT4 sp_int4_matmul
#else
int avail(void) { return sp_amx_available(); }
#define SP_INT4 sp_amx_int4_matmul
#endif
void amx(const uint16_t *x, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *scale,
         const uint16_t *zero, int64_t N, int64_t group, uint16_t *y, int nt) {
    SP_INT4(x, M, K, codes, scale, zero, N, group, y, nt);
}
void q8(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *scales, int64_t group,
        int64_t N, float *y, int nt) {
    sp_q8_matmul(x, M, K, codes, scales, 0, group, N, y, nt, sp_q8_best_isa());
}
#ifdef SP_Q8_SPLIT
void q8split(const float *x, int64_t M, int64_t K, const int8_t *codes, const int8_t *sub, const float *block,
             int64_t N, float *y, int nt) {
    sp_q8_matmul_split(x, M, K, codes, sub, block, N, y, nt, sp_q8_best_isa());
}
#endif
__attribute__((target("avx2"))) double readbw(const float *p, int64_t n, int nt) {
    double tot = 0;
#pragma omp parallel for num_threads(nt) reduction(+:tot) schedule(static)
    for (int64_t i = 0; i < n; i += 32) {
        __m256 a = _mm256_loadu_ps(p + i), b = _mm256_loadu_ps(p + i + 8);
        __m256 c = _mm256_loadu_ps(p + i + 16), d = _mm256_loadu_ps(p + i + 24);
        __m256 v = _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d));
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        tot += _mm_cvtss_f32(_mm_add_ps(h, _mm_movehl_ps(h, h)));
    }
    return tot;
}
"""
#: (name, N, K, layers): SmolLM2-1.7B in Q4_K_M (attn_v and ffn_down Q6_K in half the layers, where
#: q, k and v cannot fuse; gate and up fused)
SHAPES_1_7B = {
    "int4": [("qkv", 6144, 2048, 12), ("q,k", 2048, 2048, 24), ("o", 2048, 2048, 24),
             ("gate_up", 16384, 2048, 24), ("down", 2048, 8192, 12)],
    "int8": [("v", 2048, 2048, 12), ("down8", 2048, 8192, 12), ("lm_head", 49152, 2048, 1)],
}
P, I = ctypes.c_void_p, ctypes.c_int64
#: what a layer's time is read from (``--clock``)
CLOCK = time.perf_counter


def build(header_dir: Path, out: Path, flags: list[str]) -> ctypes.CDLL:
    src = out.with_suffix(".c")
    src.write_text(HARNESS)
    cmd = ["gcc", "-O3", "-fopenmp", "-shared", "-fPIC", *flags, f"-I{header_dir}", str(src), "-o", str(out)]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(out))
    lib.readbw.restype = ctypes.c_double
    if not lib.avail():
        raise SystemExit("this CPU or OS runs neither int4 kernel (AMX-BF16, or AVX2 and FMA)")
    return lib


def bf16(a: np.ndarray) -> np.ndarray:
    return (np.asarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def make_layers(kinds: list[str], rng: np.random.Generator) -> list[tuple]:  # type: ignore[type-arg]
    layers = []
    for kind in kinds:
        for name, n, k, count in SHAPES_1_7B[kind]:
            for _ in range(count):
                if kind == "int4":
                    codes = rng.integers(0, 256, (n // 16, k // 32, 256), dtype=np.uint8)
                    sz = bf16(rng.uniform(0.001, 0.01, (2, n // 16, k // 32, 16)))
                    layers.append((kind, name, n, k, codes, sz, None))
                else:  # Q6_K: 6-bit codes, an int8 scale per 16 times an fp16 d per 256
                    codes = rng.integers(-32, 32, (n, k), dtype=np.int8)
                    sub = rng.integers(-128, 128, (n, k // 16), dtype=np.int8)
                    block = rng.uniform(1e-6, 1e-5, (n, k // 256)).astype(np.float16).astype(np.float32)
                    scales = (np.repeat(block, 16, axis=1) * sub).astype(np.float32)
                    tiled = tuple(np.ascontiguousarray(a.reshape(n // 16, 16, -1).transpose(0, 2, 1))
                                  for a in (sub, block))
                    layers.append((kind, name, n, k, codes, scales, (sub, block, *tiled)))
    return layers


def run(lib: ctypes.CDLL, layers: list[tuple], xs: tuple[dict, dict], m: int, threads: int,  # type: ignore[type-arg]
        per: dict[str, float]) -> list[np.ndarray]:
    xb, xf = xs
    outs = []
    split, amx8 = hasattr(lib, "q8split"), hasattr(lib, "a8") and lib.amx8()
    for kind, name, n, k, codes, s, parts in layers:
        start = CLOCK()
        if kind == "int4":
            y = np.empty((m, n), np.uint16)
            lib.amx(P(xb[k].ctypes.data), I(m), I(k), P(codes.ctypes.data), P(s.ctypes.data),
                    P(s.ctypes.data + s.nbytes // 2), I(n), I(32), P(y.ctypes.data), ctypes.c_int(threads))
        elif amx8:
            y = np.empty((m, n), np.float32)
            lib.a8(P(xb[k].ctypes.data), I(m), I(k), P(codes.ctypes.data), P(parts[3].ctypes.data),
                   P(parts[2].ctypes.data), I(n), P(y.ctypes.data), ctypes.c_int(threads))
        elif split:
            y = np.empty((m, n), np.float32)
            lib.q8split(P(xf[k].ctypes.data), I(m), I(k), P(codes.ctypes.data), P(parts[0].ctypes.data),
                        P(parts[1].ctypes.data), I(n), P(y.ctypes.data), ctypes.c_int(threads))
        else:
            y = np.empty((m, n), np.float32)
            lib.q8(P(xf[k].ctypes.data), I(m), I(k), P(codes.ctypes.data), P(s.ctypes.data), I(16), I(n),
                   P(y.ctypes.data), ctypes.c_int(threads))
        per[name] = per.get(name, 0.0) + CLOCK() - start
        outs.append(y)
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="git revision whose headers are the base (default HEAD; "
                    "'tree': the working tree's, to compare flags)")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kinds", default="int4,int8")
    ap.add_argument("--base-cflags", default="", help="extra gcc flags of the base (e.g. -DSP_Q8_PREFETCH=0)")
    ap.add_argument("--tree-cflags", default="", help="extra gcc flags of the working tree's build")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="thread: the calling thread's CPU time (with --threads 1 the kernel's own; steadier "
                    "on a shared machine, blind to memory stalls' share of other processes)")
    args = ap.parse_args()
    global CLOCK
    if args.clock == "thread":
        if args.threads != 1:
            raise SystemExit("--clock thread measures the calling thread: use it with --threads 1")
        CLOCK = time.thread_time
    rows = [int(r) for r in args.rows.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="kernel_ab_"))
    (tmp / "base").mkdir()
    for h in HEADERS:
        if args.base == "tree":
            text = (ROOT / "ext" / "kernels" / h).read_text()
        else:
            shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.base}:ext/kernels/{h}"],
                                   check=False, capture_output=True, text=True)
            if shown.returncode:  # a header the revision does not have (amx_int8.h before it was added)
                continue
            text = shown.stdout
        (tmp / "base" / h).write_text(text)
    libs = {"base": build(tmp / "base", tmp / "base.so", args.base_cflags.split()),
            "tree": build(ROOT / "ext" / "kernels", tmp / "tree.so", args.tree_cflags.split())}
    rng = np.random.default_rng(0)
    layers = make_layers(args.kinds.split(","), rng)
    weight_bytes = {name: sum(lay[4].nbytes + (lay[5].nbytes if name == "base" or lay[6] is None
                                               or not hasattr(lib, "q8split") else lay[6][0].nbytes
                                               + lay[6][1].nbytes) for lay in layers)
                    for name, lib in libs.items()}
    print(f"weights read a pass: {weight_bytes}", flush=True)
    xs = {}  # each row count's bf16 x and the same values in fp32 (the int8 kernel's input)
    for m in sorted(set(rows) | {1, 3, 16, 17}):
        xb = {k: bf16(rng.standard_normal((m, k))) for k in (2048, 8192)}
        xs[m] = (xb, {k: (v.astype(np.uint32) << 16).view(np.float32) for k, v in xb.items()})
    for m in sorted(set(rows) | {1, 3, 16, 17}):
        a, b = (run(lib, layers, xs[m], m, args.threads, {}) for lib in libs.values())
        for kind in args.kinds.split(","):
            pairs = [(u, v) for u, v, lay in zip(a, b, layers) if lay[0] == kind]
            same = all(np.array_equal(u, v) for u, v in pairs)
            rel = max(float(np.abs(u.astype(np.float64) - v).max() / max(np.abs(v).max(), 1e-30))
                      for u, v in pairs if u.dtype == np.float32) if kind == "int8" else 0.0
            print(f"{m} rows, {kind}: outputs the same bits: {same}"
                  + ("" if same else f" (largest difference / largest output: {rel:.1e})"), flush=True)
    buf = np.ones(max(weight_bytes.values()) // 4 // 64 * 64, np.float32)
    res: dict[object, list] = {}  # type: ignore[type-arg]
    for _ in range(args.repeat):
        for m in rows:
            for name, lib in libs.items():
                per: dict[str, float] = {}
                run(lib, layers, xs[m], m, args.threads, per)
                res.setdefault((m, name), []).append(per)
        start = time.perf_counter()
        libs["base"].readbw(P(buf.ctypes.data), I(buf.size), ctypes.c_int(args.threads))
        res.setdefault("bw", []).append(buf.nbytes / (time.perf_counter() - start) / 1e9)
    bw = res["bw"]
    print(f"read bandwidth, {args.threads} threads: median {statistics.median(bw):.1f} GB/s, "
          f"max {max(bw):.1f} ({', '.join(f'{b:.1f}' for b in bw)})")
    for m in rows:
        for name in libs:
            pers = res[(m, name)]
            totals = [sum(p.values()) * 1e3 for p in pers]
            kinds = " ".join(f"{k} {statistics.median(p[k] for p in pers) * 1e3:.2f}" for k in pers[0])
            print(f"{m:3d} rows {name}: median {statistics.median(totals):7.2f} ms, min {min(totals):7.2f} "
                  f"(max {max(totals):7.2f}) | {kinds}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
