"""Type stub of the compiled ``proxy.quant._amx_int4`` (``ext/kernels/amx_int4.pyx``; torch twin:
``proxy.quant.amx_int4.amx_int4_mm_reference``)."""

MAX_GROUP: int

def available() -> bool: ...
def amx_int4_matmul(
    x: int, m: int, k: int, codes: int, scale: int, zero: int, n: int, group: int, out: int, num_threads: int
) -> None: ...
