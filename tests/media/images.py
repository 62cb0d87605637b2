"""Test images made in memory with Pillow, and their data URLs."""

from __future__ import annotations

import base64
import io
import struct
import zlib

from PIL import Image

COLOURS = [(255, 0, 0), (0, 128, 255), (10, 200, 30), (250, 250, 0)]


def picture(size: tuple[int, int] = (8, 6), mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A small picture of four coloured quarters (``seed`` rotates the colours), in ``mode``."""
    image = Image.new("RGB", size)
    w, h = size
    for y in range(h):
        for x in range(w):
            image.putpixel((x, y), COLOURS[(seed + 2 * (y >= h // 2) + (x >= w // 2)) % 4])
    return image if mode == "RGB" else image.convert(mode)


def encode(image: Image.Image, fmt: str = "PNG", **kw: object) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **kw)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` pixels and which has almost no data (a bomb's
    shape: the size is read before any pixel)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + \
        chunk(b"IEND", b"")
