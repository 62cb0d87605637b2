"""Type stub of the compiled ``proxy.hotpath._detokenizer`` (``ext/detokenizer.pyx``; twin:
``proxy/hotpath/python/detokenizer.py``)."""

from collections.abc import Iterable, Sequence

class DecodeTable:
    token_bytes: list[bytes]
    special_ids: frozenset[int]
    strip_leading_space: bool
    byte_fallback_ids: frozenset[int]
    def __init__(
        self,
        token_bytes: list[bytes],
        special_ids: frozenset[int],
        strip_leading_space: bool,
        byte_fallback_ids: frozenset[int] = ...,
    ) -> None: ...
    def __len__(self) -> int: ...
    def decode(self, ids: Iterable[int]) -> str: ...

class IncrementalDetokenizer:
    def __init__(self, table: DecodeTable) -> None: ...
    def feed(self, ids: Sequence[int]) -> str: ...
    def flush(self) -> str: ...
