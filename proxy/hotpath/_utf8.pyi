"""Type stub of the compiled ``proxy.hotpath._utf8`` (``ext/utf8.pyx``; twin:
``proxy/hotpath/python/utf8.py``)."""

def utf8_complete_prefix_len(buf: bytes | bytearray) -> int: ...
