"""Type stub of the compiled ``proxy.quant._q8_matmul`` (``ext/kernels/q8_matmul.pyx``; torch twin:
``proxy.quant.int8_linear.q8_matmul_reference``)."""

GROUP_SIZE: int
ISAS: dict[str, int]

def available() -> bool: ...
def supported_isas() -> list[str]: ...
def q8_matmul(
    x: int, m: int, k: int, codes: int, scales: int, group: int, n: int, out: int, num_threads: int,
    isa: int
) -> None: ...
def q8_matmul_split(
    x: int, m: int, k: int, codes: int, sub: int, block: int, n: int, out: int, num_threads: int, isa: int
) -> None: ...
