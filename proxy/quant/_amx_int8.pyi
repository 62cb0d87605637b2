"""Type stub of the compiled ``proxy.quant._amx_int8`` (``ext/kernels/amx_int8.pyx``; torch twin:
``proxy.quant.amx_int8.amx_int8_mm_reference``)."""

def available() -> bool: ...
def amx_int8_matmul(
    x: int, m: int, k: int, codes: int, scales: int, sub: int, group: int, six_bit: bool, n: int, out: int,
    num_threads: int
) -> None: ...
